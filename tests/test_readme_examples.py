"""Every Python example of README.md and docs/ runs as written and prints what its comments say.

- Each page's ```python blocks run in order in one namespace (a page reads like a notebook), in a scratch
  folder, with the repository root importable (`graphs.math.graph`, ...).
- A block that is a fragment (names from a surrounding context it does not show) is marked by the line
  `<!-- not run: why -->` right above it; every other ```python block runs.
- `print(x)  # expected`: the block's output must contain `expected` (whitespace-insensitive); `# ...`
  lines right below a print continue the expectation; an expectation with '...' in it is elided and not
  checked.
"""

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)```", flags=re.S)
NOT_RUN = re.compile(r"<!-- not run: .+ -->")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def page_blocks(page: Path) -> tuple[list[str], list[str]]:
    """(blocks that run, fragments marked not run) of a page, in order."""
    run, fragments = [], []
    for m in BLOCK.finditer("\n" + page.read_text()):
        (fragments if NOT_RUN.fullmatch(m["before"].strip()) else run).append(m["code"])
    return run, fragments


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
            "docs/guide/training.md"} <= names
    interrupts, _ = page_blocks(ROOT / "docs" / "guide" / "interrupts.md")
    assert len(interrupts) == 3 and sum(len(expectations(b)) for b in interrupts) == 4
    assert all(len(page_blocks(p)[0]) + len(page_blocks(p)[1]) == p.read_text().count("```python\n") for p in pages())


@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_examples_run_and_print_what_they_say(page, tmp_path, monkeypatch):
    blocks, _ = page_blocks(page)
    if any(re.search(r"^\s*(from|import) deepagents\b", b, flags=re.M) for b in blocks):
        pytest.importorskip("deepagents")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    namespace: dict = {"__name__": "docs_example"}
    for index, block in enumerate(blocks):
        where = f"{page.relative_to(ROOT)} example {index}"
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            exec(compile(block, where, "exec"), namespace)  # noqa: S102 - our own documentation
        printed = " ".join(stdout.getvalue().split())
        for expected in expectations(block):
            assert expected in printed, f"{where}: {expected!r} not in {printed!r}"
