"""The README's section "Interrupts, conversations and named agents" runs as written and prints what its
comments say (`print(x)  # expected`; `# ...` lines right below a print hold or continue the expectation;
an expectation with '...' in it is elided and not checked)."""

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SECTION = "## Interrupts, conversations and named agents"


def section_blocks() -> list[str]:
    text = README.read_text()
    body = text[text.index(SECTION):]
    body = body[: body.index("\n## ", len(SECTION))]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


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


def test_the_section_has_an_example_of_each_feature():
    blocks = section_blocks()
    assert len(blocks) == 4 and sum(len(expectations(b)) for b in blocks) == 5


@pytest.mark.parametrize("index", range(4))
def test_readme_example_runs_and_prints_what_it_says(index):
    pytest.importorskip("deepagents")
    block = section_blocks()[index]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(block, f"README example {index}", "exec"), {"__name__": "readme_example"})  # noqa: S102
    printed = " ".join(stdout.getvalue().split())
    for expected in expectations(block):
        assert expected in printed, f"README example {index}: {expected!r} not in {printed!r}"
