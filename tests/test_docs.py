"""The documentation site builds without a warning, its generated reference pages match the code, every YAML
block is a training config the command line accepts, and the README stays a front page whose links lead into
docs/. (The examples run in tests/test_readme_examples.py.)"""

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
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
                        "traces rescore", "train", "eval", "check", "config-doc", "warm-start", "ui"]
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


YAML_BLOCK = re.compile(r"(?P<before>[^\n]*)\n(?P<indent>[ \t]*)```ya?ml\n(?P<text>.*?)```", flags=re.S)
"""A ```yaml block, also one indented inside a list item."""
NOT_A_CONFIG = re.compile(r"<!-- not a config: .+ -->")
PYTHON_BLOCK = re.compile(r"```python\n(?P<code>.*?)```", flags=re.S)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _config_blocks(page: Path) -> list[str]:
    """The ```yaml blocks of a page that are training configs (all but those marked `<!-- not a config: why -->`)."""
    return [textwrap.dedent(m["text"]) for m in YAML_BLOCK.finditer("\n" + page.read_text())
            if not NOT_A_CONFIG.fullmatch(m["before"].strip())]


def test_every_yaml_block_is_a_training_config(tmp_path):
    """A YAML block on a page is what a user copies into cfg.yaml: it must load as the command line loads it
    (`load_config`: unknown keys, wrong types and inconsistent sections are errors naming the field)."""
    from drmas_graph.config import load_config

    checked = {}
    for page in _pages():
        for index, text in enumerate(_config_blocks(page)):
            path = tmp_path / f"{page.stem}-{index}.yaml"
            path.write_text(text)
            load_config(path)  # raises ConfigError naming the page's block (its file name) and the field
            checked[page.relative_to(ROOT).as_posix()] = index + 1
    assert sum(checked.values()) >= 15, checked
    assert {"docs/tutorial.md", "docs/guide/howto.md", "docs/guide/training.md", "docs/guide/scaling.md", "docs/guide/memory.md",
            "docs/guide/async.md", "docs/guide/served.md", "docs/guide/unfinished.md"} <= set(checked)


def test_how_to_pages_that_train_in_python_show_the_yaml_too():
    """The command line is driven by YAML: a guide page whose Python examples configure training (train_graph,
    TrainConfig) also shows the config a `drmas-graph train cfg.yaml` run takes."""
    pages = [p for p in sorted((ROOT / "docs" / "guide").glob("*.md"))
             if any(re.search(r"\b(train_graph|TrainConfig)\(", m["code"]) for m in PYTHON_BLOCK.finditer(p.read_text()))]
    assert len(pages) >= 8, [p.name for p in pages]
    assert [p.name for p in pages if not _config_blocks(p)] == []


def test_a_yaml_block_that_is_not_a_config_is_refused(tmp_path):
    from drmas_graph.config import load_config
    from drmas_graph.errors import ConfigError

    path = tmp_path / "cfg.yaml"
    path.write_text("agents:\n  solver: {model: m, frozen: yes, lr_typo: 1}\n")
    with pytest.raises(ConfigError, match=r"agents.solver.lr_typo"):
        load_config(path)


def test_the_code_map_names_every_sub_package_and_what_it_may_import():
    """docs/explanation/design.md's table has a row per layer of tests/test_layout.py, whose 'may import' cell
    says what LAYERS says."""
    from tests.test_layout import LAYERS

    LAYERS = {k: v for k, v in LAYERS.items() if "." not in k}  # train's groups are on the page's train/ map
    page = (ROOT / "docs" / "explanation" / "design.md").read_text()
    row = re.compile(r"^\| `(?P<name>\w+)(?:/|\.py)` \| [^|]+ \| (?P<imports>[^|]+) \|", flags=re.M)
    rows = {m["name"]: m["imports"].strip() for m in row.finditer(page)}
    assert set(rows) == set(LAYERS) - {"shared"}
    for layer, cell in rows.items():
        others = set(LAYERS) - {"shared", layer}
        named = {"shared only": set(), "every sub-package above": others}.get(cell, set(re.findall(r"`(\w+)`", cell)))
        assert named == LAYERS[layer], (layer, cell)
