"""Check that moving the README into docs/ kept every fact: each number and each sentence with
'not' / 'never' / 'only' / 'limit' of an old README must appear somewhere in README.md + docs/.

    python scripts/check_docs_facts.py [REV]     # REV: the commit whose README.md is the reference (c9da17d)

Exit status 0 when everything is found, 1 otherwise (the missing items are printed). Comparison ignores
whitespace, Markdown link targets (a link's text is kept) and emphasis; numbers are compared as tokens
(`4.17x`, `0.237`, `2026-12-02`, `1,441`), each as often as before (code blocks included). Not a test: the reference README is frozen, the docs move on.
"""

from __future__ import annotations

import re
from collections import Counter
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"(?<![\w.])\d(?:\d|,(?=\d))*(?:\.\d+)?(?:e-?\d+)?[a-zA-Z%]*")
# Where the old README pointed "below", the docs name the page the text moved to; nothing else is reworded.
MOVED = {
    "or it failed otherwise (below)": "or it failed otherwise (Episodes that do not finish)",
    "continue the thread: below)": "continue the thread: Interrupts and conversations)",
    "(the structured output asked for, below)": "(the structured output asked for: Structured output)",
    "Deep Agents sub-agents).": "Deep Agents sub-agents: Agents and names).",
    "In the measurement below it": "In the measurement it",
}
CAVEAT = re.compile(r"\b(not|never|only|limits?|cannot|n't)\b", flags=re.I)


def normalize(text: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # [text](target) -> text
    text = text.replace("**", "").replace("<!-- config-table:start -->", "").replace("<!-- config-table:end -->", "")
    return " ".join(text.split())


def sentences(markdown: str) -> list[str]:
    """Sentences of prose, bullets and table rows (code blocks left out: commands are checked as numbers)."""
    prose = re.sub(r"```.*?```", "\n\n", markdown, flags=re.S)
    out = []
    for paragraph in re.split(r"\n\s*\n|\n(?=\s*[-|] )|\n(?=#)", prose):
        text = normalize(paragraph).lstrip("-# ").strip()
        if text.startswith("|"):
            out.append(text)
            continue
        out += [s.strip() for s in re.split(r"(?<=[.!?:])\s+(?=[A-Z(`*\"])", text) if s.strip()]
    return out


def moved(sentence: str) -> str:
    for old, new in MOVED.items():
        sentence = sentence.replace(old, new)
    return sentence


def main(rev: str = "c9da17d") -> int:
    old = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:README.md"], capture_output=True, text=True,
                         check=True).stdout
    new_files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    new = normalize("\n\n".join(p.read_text() for p in new_files))
    old_counts, new_counts = Counter(NUMBER.findall(normalize(old))), Counter(NUMBER.findall(new))
    numbers = sorted(n for n in old_counts if new_counts[n] < old_counts[n])  # each occurrence, not just one
    caveats = [s for s in dict.fromkeys(sentences(old)) if CAVEAT.search(s) and moved(s) not in new]
    print(f"numbers: {len(old_counts) - len(numbers)} of {len(old_counts)} distinct numbers found as often as before")
    for n in numbers:
        print(f"  missing number: {n} ({old_counts[n]} times before, {new_counts[n]} now)")
    total = sum(1 for s in dict.fromkeys(sentences(old)) if CAVEAT.search(s))
    print(f"sentences with not/never/only/limit: {total - len(caveats)} of {total} found verbatim")
    for s in caveats:
        print(f"  missing sentence: {s}")
    return 1 if numbers or caveats else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
