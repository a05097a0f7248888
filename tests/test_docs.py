"""The documentation site builds without a warning, its generated reference pages match the code, and the
README stays a front page whose links lead into docs/. (The examples run in tests/test_readme_examples.py.)"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _gen_reference():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", ["config.md", "cli.md", "metrics.md", "api.md"])
def test_generated_reference_pages_are_up_to_date(page):
    expected = _gen_reference().PAGES[page]()
    actual = (ROOT / "docs" / "reference" / page).read_text()
    assert actual == expected, f"docs/reference/{page} is stale: run python scripts/gen_reference.py"


def test_the_config_reference_lists_every_field():
    from drmas_graph.config import config_reference

    page = (ROOT / "docs" / "reference" / "config.md").read_text()
    fields = [f for f, _, _ in config_reference()]
    assert len(fields) > 100 and all(f"| `{f}` |" in page for f in fields)
    assert "| `async.max_staleness` | `0` | Most updates the weights that sampled a trained group may lag" in page


def test_the_cli_reference_lists_every_command():
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    commands = re.findall(r"^## `drmas-graph ([a-z -]+)`$", page, flags=re.M)
    assert commands == ["traces list", "traces show", "traces stats", "traces export", "traces replay",
                        "traces rescore", "train", "eval", "check", "config-doc", "ui"]
    assert "| `--set KEY=VALUE` | override a config field | repeatable |" in page


def test_mkdocs_build_strict(tmp_path):
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason="the docs extra is not installed: pip install -e '.[docs]'")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert build.returncode == 0, build.stdout + build.stderr
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "drmas_graph.train.loop.trainer.train_graph" in api and "Train the policies behind" in api


def test_readme_is_a_front_page_that_links_into_the_guide():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert "docs/tutorial.md" in local and len(local) >= 20
    assert [link for link in local if not (ROOT / link).exists()] == []
