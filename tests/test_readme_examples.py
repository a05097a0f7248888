"""Every Python example of README.md and docs/ runs as written and prints what its comments say.

- Each page's ```python blocks run in order in one namespace (a page reads like a notebook), in a scratch
  folder, with the repository root importable (`graphs.math.graph`, ...).
- A block that is a fragment (names from a surrounding context it does not show) is marked by the line
  `<!-- not run: why -->` right above it; every other ```python block runs.
- `print(x)  # expected`: the block's output must contain `expected` (whitespace-insensitive); `# ...`
  lines right below a print continue the expectation; an expectation with '...' in it is elided and not
  checked.
- A ```yaml block with the line `<!-- file: NAME -->` right above it is a file the page's examples use (a
  training config, as `drmas-graph train NAME` reads it): it is written to the scratch folder before the
  page's first block runs. (tests/test_docs.py parses every ```yaml block into a TrainConfig.)
- A block that needs a server runs only where that server is available: `<!-- needs ENV_VAR: why -->` right
  above it runs the block when the environment variable ENV_VAR is set (`DRMAS_VLLM_PYTHON`: the vLLM
  environment, as tests/test_served_vllm.py), and skips it (and the page's later blocks) otherwise.
"""

import contextlib
import io
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)```", flags=re.S)
NOT_RUN = re.compile(r"<!-- not run: .+ -->")
NEEDS = re.compile(r"<!-- needs (?P<var>[A-Z_][A-Z0-9_]*): .+ -->")
FILE = re.compile(r"<!-- file: (?P<name>[\w.-]+) -->\n```ya?ml\n(?P<text>.*?)```", flags=re.S)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def page_blocks(page: Path) -> tuple[list[str], list[str]]:
    """(blocks that run, fragments marked not run) of a page, in order."""
    run, fragments = [], []
    for m in BLOCK.finditer("\n" + page.read_text()):
        (fragments if NOT_RUN.fullmatch(m["before"].strip()) else run).append(m["code"])
    return run, fragments


def block_needs(page: Path) -> list[str | None]:
    """Per block that runs: the environment variable it needs (`<!-- needs VAR: why -->`), else None."""
    out = []
    for m in BLOCK.finditer("\n" + page.read_text()):
        before = m["before"].strip()
        if not NOT_RUN.fullmatch(before):
            needs = NEEDS.fullmatch(before)
            out.append(needs["var"] if needs else None)
    return out


def page_files(page: Path) -> dict[str, str]:
    """The files a page's examples use: name -> text of each ```yaml block marked `<!-- file: NAME -->`."""
    files = {m["name"]: m["text"] for m in FILE.finditer(page.read_text())}
    assert len(files) == len(FILE.findall(page.read_text())), f"{page}: two file blocks with one name"
    return files


def expectations(block: str) -> list[str]:
    out, lines = [], block.splitlines()
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("print("):
            continue
        expected = [line.split("  # ", 1)[1]] if "  # " in line else []
        for more in lines[i + 1:]:
            if not more.startswith("# "):
                break
            expected.append(more[2:])
        if not expected or "..." in " ".join(expected):
            continue
        out.append(" ".join(" ".join(expected).split()))
    return out


PAGES_WITH_EXAMPLES = [p for p in pages() if page_blocks(p)[0]]


def test_the_examples_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES_WITH_EXAMPLES}
    assert {"README.md", "docs/tutorial.md", "docs/guide/interrupts.md", "docs/guide/agents.md",
            "docs/guide/training.md", "docs/guide/howto.md"} <= names
    interrupts, _ = page_blocks(ROOT / "docs" / "guide" / "interrupts.md")
    assert len(interrupts) == 4 and sum(len(expectations(b)) for b in interrupts) == 5
    howto = ROOT / "docs" / "guide" / "howto.md"
    assert sorted(page_files(howto)) == ["frozen.yaml", "mixed.yaml", "zero3.yaml"]
    assert block_needs(howto).count("DRMAS_VLLM_PYTHON") == 1 and block_needs(howto)[-1] == "DRMAS_VLLM_PYTHON"
    assert all(len(page_blocks(p)[0]) + len(page_blocks(p)[1]) == p.read_text().count("```python\n") for p in pages())


@pytest.fixture
def fresh_process_group(monkeypatch):
    """The pages' examples see the launcher's variables as a fresh process does: the one-process group an
    earlier test's DeepSpeed engine left behind (kept for the DeepSpeed tests after this one, which hold on to
    it) would otherwise answer `world_size()` instead of the WORLD_SIZE an example sets (docs/guide/howto.md's
    launch checks). A group of one process and no launcher variables give the same answers either way."""
    import torch.distributed as dist

    from drmas_graph.engine import _world

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1:
        monkeypatch.setattr(_world, "group_initialized", lambda: False)
    yield


@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_examples_run_and_print_what_they_say(page, tmp_path, monkeypatch, fresh_process_group):
    blocks, _ = page_blocks(page)
    if any(re.search(r"^\s*(from|import) deepagents\b", b, flags=re.M) for b in blocks):
        pytest.importorskip("deepagents")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    for name, text in page_files(page).items():
        (tmp_path / name).write_text(text)
    namespace: dict = {"__name__": "docs_example"}
    for index, (block, needs) in enumerate(zip(blocks, block_needs(page), strict=True)):
        where = f"{page.relative_to(ROOT)} example {index}"
        if needs is not None and not os.environ.get(needs):
            pytest.skip(f"{where} and the page's later examples need {needs} (a server); ran {index} examples")
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            exec(compile(block, where, "exec"), namespace)  # noqa: S102 - our own documentation
        printed = " ".join(stdout.getvalue().split())
        for expected in expectations(block):
            assert expected in printed, f"{where}: {expected!r} not in {printed!r}"
