"""Copy every bench/results/<capability>.md table, and its plots (<capability>*.png), into the
README's benchmark section.

Run after a benchmark: ``python bench/update_readme.py``. Everything after the
``<!-- BENCH TABLES -->`` marker is regenerated; nothing above it changes. Headings of a
result file sit below the README's own, and a long file is cut at a section boundary with a
link to the whole of it, so the README stays readable.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- BENCH TABLES -->"
ORDER = [
    "controller",
    "controller_ray",
    "controller_failover",
    "controller_containers",
    "aggregation",
    "aggregation_tenants",
    "aggregation_training",
    "flsched",
    "partition",
    "partition_pipeline_testbed",
    "partition_pipeline",
    "gateway",
    "gateway_sandbox",
]
COMMAND = {
    "controller_ray": "python bench/controller.py --ray",
    "controller_failover": "python bench/controller.py --failover",
    "controller_containers": "python bench/controller.py --containers",
    "partition_pipeline": "python bench/partition.py --pipeline-only",
    "partition_pipeline_testbed": "python bench/partition.py --pipeline-testbed",
    "gateway_sandbox": "python bench/gateway_sandbox.py",
}
MAX_LINES = 70  # of one capability's results in the README


def excerpt(text: str, link: str) -> str:
    """``text`` with headings demoted under the README's ``###``, cut to about MAX_LINES."""
    lines = [
        re.sub(r"^(#{1,3}) ", lambda m: "#" * (len(m.group(1)) + 3) + " ", line) for line in text.strip().splitlines()
    ]
    if len(lines) <= MAX_LINES:
        return "\n".join(lines)
    cut = max((n for n, line in enumerate(lines[:MAX_LINES]) if n > 0 and line.startswith("#")), default=None)
    if cut is None:
        cut = next((n for n in range(MAX_LINES, len(lines)) if not lines[n].strip()), len(lines))
    return "\n".join(lines[:cut]).rstrip() + f"\n\nThe rest (per-case tables): [{link}]({link})."


def main() -> None:
    readme = ROOT / "README.md"
    head = readme.read_text().split(MARKER)[0]
    sections = []
    for name in ORDER:
        table = ROOT / "bench" / "results" / f"{name}.md"
        shown = table.read_text() if table.is_file() else ""
        plots = "".join(
            f"![{png.stem}](bench/results/{png.name})\n\n"
            for png in sorted((ROOT / "bench" / "results").glob(f"{name}*.png"))
            if png.stem.split("-")[0] == name and not re.search(r"\]\([^)]*" + re.escape(png.name), shown)
        )  # not embedded already
        if table.is_file():
            command = COMMAND.get(name, f"python bench/{name}.py")
            sections.append(
                f"### {name}\n\n`{command}` -> `bench/results/{name}.json`\n\n"
                + plots
                + excerpt(table.read_text(), f"bench/results/{name}.md")
                + "\n"
            )
        else:
            sections.append(f"### {name}\n\nNo results yet: run `python bench/{name}.py`.\n")
    readme.write_text(head + MARKER + "\n\n" + "\n".join(sections))


if __name__ == "__main__":
    main()
