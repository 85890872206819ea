"""The import layers of the ``trainmaster`` package: printed, and checked by ``make lint``.

    python tools/layers.py            # the layers, the arrows between units, and every violation
    python tools/layers.py --quiet    # only the violations and the counts (what ``make lint`` prints)
    python tools/layers.py --edges    # also every import between units, with file and line
    python tools/layers.py --deferred # also every in-function import allowed by DEFERRED

Every module belongs to one *unit* (a folder, or a few modules of one), and every unit sits on
one *layer* (:data:`LAYERS`, ground floor first; the same table is in docs/architecture.md). The
check fails (exit 1) on

* a back-arrow: a module importing one of a higher layer;
* a cycle: modules that import each other, directly or around a circle (any import counts,
  also one inside a function or under ``TYPE_CHECKING``), or units that do;
* an in-function import of our own modules that is not for an optional heavy extra: allowed
  only where the imported module pulls one of :data:`OPTIONAL_EXTRAS` in when imported, or where
  :data:`DEFERRED` names the importing module (or its unit) with its reason.

It reads the source with :mod:`ast` and imports nothing, so it runs without the package's
dependencies. A dev tool: it is not part of the installed package.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "trainmaster"

#: Ground floor first. A unit is named by module prefixes: a module belongs to the unit of its
#: longest matching prefix. Units on one layer may import each other, never in a circle.
LAYERS: list[tuple[str, dict[str, tuple[str, ...]]]] = [
    (
        "ground",
        {
            "errors": ("trainmaster.errors",),
            "contract": ("trainmaster.contract",),
            "spec": ("trainmaster.spec",),
        },
    ),
    (
        "store",
        {
            "store": ("trainmaster.store",),
            # what an instance's own code calls: trainmaster.report() / publish() write the store
            "reporting": (
                "trainmaster",
                "trainmaster.runtime.report",
                "trainmaster.runtime.views",
                "trainmaster.runtime.channel",  # the instance's client of its channel (stdlib only)
            ),
            "containers": ("trainmaster.containers",),
        },
    ),
    (
        "agent and capabilities",
        {
            "agent": ("trainmaster.agent",),
            "aggregation": ("trainmaster.aggregation",),
            "flsched": ("trainmaster.flsched",),
            "partition": ("trainmaster.partition",),
            "gateway": ("trainmaster.gateway",),
            "workloads": ("trainmaster.workloads",),
        },
    ),
    (
        "frameworks",
        {
            "frameworks": ("trainmaster.frameworks",),
            "testbed": ("trainmaster.testbed",),
            "cluster": ("trainmaster.cluster",),  # a Kubernetes cluster of this machine, like the testbed
        },
    ),
    ("instance runtime", {"runtime": ("trainmaster.runtime",)}),
    (
        "controller",
        {
            "loading": ("trainmaster.loading",),
            "controller": ("trainmaster.controller", "trainmaster.backends.base"),
        },
    ),
    ("backends", {"backends": ("trainmaster.backends",)}),
    (
        "api",
        {
            "api": ("trainmaster.api",),  # the local implementation of the client protocol
            "client": ("trainmaster.client",),  # the protocol, its results, the HTTP implementation
        },
    ),
    (
        "service",
        {
            "service": ("trainmaster.service",),
            "operator": ("trainmaster.operator",),  # the controller as a Kubernetes operator
        },
    ),
    ("cli", {"cli": ("trainmaster.cli", "trainmaster.__main__")}),
]

#: Optional extras (pyproject's [project.optional-dependencies]) whose import is heavy: an
#: in-function import of a module that pulls one of them in keeps the rest light without it.
OPTIONAL_EXTRAS = frozenset(
    {"torch", "sklearn", "pymetis", "kahip", "onnx", "transformers", "pyarrow", "ray", "psycopg", "mpi4py"}
)

#: Modules (or whole units) whose in-function imports of our own modules are deliberate, and why.
DEFERRED: dict[str, str] = {
    "cli": "each verb imports its machinery when it runs: `trainmaster --help` imports ~80 ms of "
    "modules instead of seconds (the facade with the store ~1.7 s, the service ~2.5 s, the gateway "
    "~3.6 s, measured with -X importtime on a loaded 2-core machine)",
    "trainmaster": "`import trainmaster` in role code stays light: report() and publish() load the "
    "store only when called",
    "trainmaster.runtime.launch": "the wait step starts with `python -S`: the store, the environment "
    "resolver and the container runtime import only after site.main() made the installed packages importable",
    "trainmaster.runtime.report": "a role that never reports never imports the store (SQLAlchemy)",
    "trainmaster.runtime.views": "a role that never publishes imports nothing of the channel's",
    "trainmaster.store.db": "Alembic loads only when a store is created or upgraded, not in each "
    "instance's wait step (make_engine(create=False))",
    "trainmaster.frameworks.crosssilo": "the gateway (FastAPI, cryptography) loads when a cross-silo "
    "role runs or its keys are provisioned, not when a cross-silo job is validated",
    "trainmaster.frameworks.pipeline": "the partitioner (SciPy) loads when a pipeline job's methods are "
    "checked, not when the framework registry loads the framework",
    # the capability libraries' own lazy imports, left to their owners (issue 33 moved none of them)
    "aggregation": "owned by the aggregation capability; not reviewed here",
    "flsched": "owned by the flsched capability; not reviewed here",
    "partition": "owned by the partition capability; not reviewed here",
    "gateway": "owned by the gateway capability; not reviewed here",
}


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module of ours
    line: int
    where: str  # "top", "type" (under TYPE_CHECKING) or "function"


def modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every module of the package."""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    """Every import of our own modules in ``path`` (a ``from a import b`` of a submodule ``b``
    names ``a.b``; of anything else, ``a``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def resolve(module: str) -> str | None:
        while module and module not in known:
            module = module.rpartition(".")[0]
        return module or None

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = "function"
            elif isinstance(child, ast.If) and where == "top" and "TYPE_CHECKING" in ast.unparse(child.test):
                inner = "type"
            if isinstance(child, ast.Import):
                for alias in child.names:
                    target = resolve(alias.name) if alias.name.split(".")[0] == PACKAGE else None
                    if target:
                        found.append(Import(name, target, child.lineno, where))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    module = ".".join([*base, *([child.module] if child.module else [])])
                else:
                    module = child.module or ""
                if module.split(".")[0] == PACKAGE:
                    for alias in child.names:
                        full = f"{module}.{alias.name}"
                        target = full if full in known else resolve(module)
                        if target:
                            found.append(Import(name, target, child.lineno, where))
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), "top")
    return found


def third_party(path: Path) -> set[str]:
    """Top-level distributions a module imports at its top level (functions excluded)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        stack: list[ast.AST] = [node]
        while stack:
            item = stack.pop()
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(item, ast.Import):
                names.update(alias.name.split(".")[0] for alias in item.names)
            elif isinstance(item, ast.ImportFrom) and not item.level and item.module:
                names.add(item.module.split(".")[0])
            stack.extend(ast.iter_child_nodes(item))
    return names


class Units:
    """Module -> unit -> layer, from :data:`LAYERS`."""

    def __init__(self) -> None:
        self.layer: dict[str, int] = {}
        self.prefixes: list[tuple[str, str]] = []
        for number, (_, units) in enumerate(LAYERS):
            for unit, prefixes in units.items():
                self.layer[unit] = number
                self.prefixes += [(prefix, unit) for prefix in prefixes]
        self.prefixes.sort(key=lambda item: -len(item[0]))

    def of(self, module: str) -> str:
        for prefix, unit in self.prefixes:
            if module == prefix or module.startswith(prefix + "."):
                return unit
        raise SystemExit(f"tools/layers.py: {module} belongs to no unit; add it to LAYERS")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def heavy(known: dict[str, Path], top: dict[str, set[str]]) -> set[str]:
    """Modules that pull an optional extra in when imported (themselves, or through the modules
    they import at their top level)."""
    direct = {m for m, path in known.items() if third_party(path) & OPTIONAL_EXTRAS}
    pulled = set(direct)
    changed = True
    while changed:
        changed = False
        for module, targets in top.items():
            if module not in pulled and targets & pulled:
                pulled.add(module)
                changed = True
    return pulled


def check(root: Path, show: str) -> int:
    known = modules(root)
    units = Units()
    every = [i for name, path in known.items() for i in imports(name, path, known) if i.target != name]
    top: dict[str, set[str]] = defaultdict(set)
    graph: dict[str, set[str]] = defaultdict(set)
    for i in every:
        graph[i.source].add(i.target)
        if i.where == "top":
            top[i.source].add(i.target)
    unit_of = {m: units.of(m) for m in known}
    back = [i for i in every if units.layer[unit_of[i.target]] > units.layer[unit_of[i.source]]]
    unit_graph: dict[str, set[str]] = defaultdict(set)
    for i in every:
        if unit_of[i.source] != unit_of[i.target]:
            unit_graph[unit_of[i.source]].add(unit_of[i.target])
    module_cycles = cycles(graph)
    unit_cycles = cycles(unit_graph)
    pulls_extra = heavy(known, top)
    deferred = [i for i in every if i.where == "function"]
    for_extra = [i for i in deferred if i.target in pulls_extra]
    with_reason = [
        i for i in deferred if i.target not in pulls_extra and (i.source in DEFERRED or unit_of[i.source] in DEFERRED)
    ]
    unjustified = [i for i in deferred if i not in for_extra and i not in with_reason]

    if show not in ("quiet", "deferred"):
        print_layers(known, every, units, unit_of, show == "edges")
    for i in back:
        print(
            f"back-arrow: {i.source} ({unit_of[i.source]}, layer {units.layer[unit_of[i.source]]}) imports "
            f"{i.target} ({unit_of[i.target]}, layer {units.layer[unit_of[i.target]]}) "
            f"at {known[i.source].relative_to(root)}:{i.line}"
        )
    for members in unit_cycles:
        print(f"cycle of units: {' <-> '.join(members)}")
    for members in module_cycles:
        print(f"cycle of modules: {' <-> '.join(members)}")
    for i in unjustified:
        print(
            f"in-function import: {known[i.source].relative_to(root)}:{i.line} imports {i.target} (no optional extra)"
        )
    if show == "deferred":
        for i in with_reason:
            print(f"deferred: {known[i.source].relative_to(root)}:{i.line} imports {i.target}")

    def statements(found: list[Import]) -> int:
        return len({(i.source, i.line) for i in found})

    print(
        f"{len(known)} modules, {len(every)} imports of our own modules; back-arrows: {len(back)}, "
        f"cycles: {len(unit_cycles)} of units + {len(module_cycles)} of modules; in-function import "
        f"statements: {statements(deferred)} ({statements(for_extra)} for an optional extra, "
        f"{statements(with_reason)} deferred with a reason in DEFERRED, {statements(unjustified)} without one)"
    )
    return 1 if back or unit_cycles or module_cycles or unjustified else 0


def print_layers(
    known: dict[str, Path], every: Iterable[Import], units: Units, unit_of: dict[str, str], edges: bool
) -> None:
    arrows: dict[str, dict[str, list[Import]]] = defaultdict(lambda: defaultdict(list))
    for i in every:
        if unit_of[i.source] != unit_of[i.target]:
            arrows[unit_of[i.source]][unit_of[i.target]].append(i)
    size = defaultdict(int)
    for module in known:
        size[unit_of[module]] += 1
    for number, (title, members) in reversed(list(enumerate(LAYERS))):
        print(f"layer {number}: {title}")
        for unit in members:
            targets = arrows.get(unit, {})
            shown = ", ".join(
                f"{target}{'' if units.layer[target] <= number else ' (UP)'}" for target in sorted(targets)
            )
            print(f"    {unit:<12} {size[unit]:>3} module(s)  -> {shown or '(nothing of ours)'}")
            if edges:
                for target in sorted(targets):
                    for i in targets[target]:
                        print(f"        {i.source} -> {i.target} ({i.where}, line {i.line})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quiet", action="store_true", help="only the violations and the counts")
    parser.add_argument("--edges", action="store_true", help="every import between units, with its line")
    parser.add_argument("--deferred", action="store_true", help="also every in-function import DEFERRED allows")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this one)")
    args = parser.parse_args(argv)
    show = "quiet" if args.quiet else "edges" if args.edges else "deferred" if args.deferred else "layers"
    return check(args.root, show)


if __name__ == "__main__":
    sys.exit(main())
