"""Regenerate the config-field table in README.md from drmas_graph.config (tests check they agree).

    python scripts/gen_config_table.py
"""

from pathlib import Path

from drmas_graph.config import config_reference

START, END = "<!-- config-table:start -->", "<!-- config-table:end -->"


def table() -> str:
    rows = ["| field | default | meaning |", "|---|---|---|"]
    rows += [f"| `{f}` | `{d}` | {desc.replace('|', '/')} |" for f, d, desc in config_reference()]
    return "\n".join(rows)


def main() -> None:
    readme = Path(__file__).resolve().parents[1] / "README.md"
    text = readme.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    readme.write_text(f"{head}{START}\n{table()}\n{END}{tail}")


if __name__ == "__main__":
    main()
