"""Copy every bench/results/<capability>.md table into the README's benchmark section.

Run after a benchmark: ``python bench/update_readme.py``. Everything after the
``<!-- BENCH TABLES -->`` marker is regenerated; nothing above it changes.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- BENCH TABLES -->"
ORDER = ["controller", "aggregation", "flsched", "partition", "gateway"]


def main() -> None:
    readme = ROOT / "README.md"
    head = readme.read_text().split(MARKER)[0]
    sections = []
    for name in ORDER:
        table = ROOT / "bench" / "results" / f"{name}.md"
        if table.is_file():
            sections.append(f"### {name}\n\n`python bench/{name}.py` -> `bench/results/{name}.json`\n\n"
                            + table.read_text().strip() + "\n")
        else:
            sections.append(f"### {name}\n\nNo results yet: run `python bench/{name}.py`.\n")
    readme.write_text(head + MARKER + "\n\n" + "\n".join(sections))


if __name__ == "__main__":
    main()
