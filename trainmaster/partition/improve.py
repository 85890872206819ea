"""The final improvement phase: multilevel local search on the true objective.

Everything before this phase works on estimates (cut weights, list-scheduling starts, a descent
that only looks along the schedule's critical chain); the user is judged by the simulated
makespan. This phase takes one partition and tries, level by level from coarse to fine (chain
segments, then co-location clusters), to send each unit to each other device, or, where the
caps refuse the move, to swap it with the smallest unit of the target device that makes room.
A trial is simulated; it is kept only when it keeps every constraint (the load and memory caps,
co-location: units are whole clusters, a ceiling on the static critical cut, an acyclic device
graph when asked) and lowers the makespan. The sweeps repeat until one whole pass over every
level finds nothing, or the budget of simulations is spent.

The guarantee is structural: the phase holds its start and replaces it only by a partition whose
makespan, simulated the same way, is strictly lower and which meets the same constraints, so it
never returns a partition worse than the one it was given (``improve``; tested on random graphs
in tests/partition/test_partition_improve.py). Seeded with METIS's own partition, its result is
never slower than METIS's and never cuts more critical cost than the ceiling (METIS's own cut).

Why every device and not only the neighbours' (as FM and the descent do): on transfer-heavy
graphs a move to an idle device that no neighbour sits on frees its old device for the chain
that waits there, and a later move brings a neighbour over; measured on synthetic DAGs with
transfers 3x the compute, neighbour-only moves gave back 4% of the gap to METIS and all-device
moves 22% (bench/partition_history.md).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from trainmaster.partition.graph import Graph
from trainmaster.partition.simulate import TrialSimulator, device_graph_acyclic, finish_times, sim_plan

__all__ = ["Improvement", "improve"]


@dataclass
class Improvement:
    """The improved partition, its makespan (as ``improve`` simulates it), the simulations run
    and the moves kept."""

    assignment: np.ndarray
    makespan: float
    simulations: int
    moves: int


def improve(
    graph: Graph,
    start: np.ndarray,
    k: int,
    cap: float,
    mem_cap: float,
    units: list[np.ndarray],
    budget: int,
    guarded: np.ndarray | None = None,
    ceiling: float = float("inf"),
    acyclic: bool = False,
    shared_links: bool = False,
    reach: float | None = None,
) -> Improvement:
    """Local search from ``start`` on the simulated makespan (module docstring).

    ``units``: node -> unit maps, coarse first (each a union of co-location clusters, the last
    usually the clusters themselves); ``budget``: the most trial simulations; ``guarded``
    (per-edge weights, e.g. transfer cost on static critical edges) with ``ceiling``: no kept
    partition cuts more guarded weight than that; ``acyclic``: the device graph stays a DAG;
    ``shared_links``: makespans are simulated with messages queueing on the devices' links
    (``simulate.schedule``), the same way the result is judged. ``reach``: a guarded cut to get
    down to (METIS's critical cut, where the start cuts more: its partition broke a cap and no
    candidate within the caps cut as little): while the cut is above it, a move that lowers the
    cut is kept whatever it does to the makespan (the ceiling is then the current cut), and once
    at or below it, no move goes above it again. Never returns a partition with a higher
    makespan than ``start``'s when the start's cut is at or below ``reach`` (or ``reach`` is
    None): the guarantee the METIS-seeded run rests on."""
    state = _State(graph, start, k, cap, mem_cap, guarded, ceiling, acyclic, shared_links)
    state.reach = ceiling if reach is None else reach
    if not state.valid:
        return Improvement(state.assignment(), state.span, 0, 0)
    levels = [_Units(np.asarray(u), state.rank, state.cost, state.memory) for u in units]
    finest = levels[-1] if levels else None
    while state.simulations < budget:
        before = state.moves
        for level in levels:
            _sweep(state, level, finest, budget)
            if state.simulations >= budget:
                break
        if state.moves == before:
            break
    return Improvement(state.assignment(), state.span, state.simulations, state.moves)


class _Units:
    """The members of each unit of one level, with their load and memory, units in the order of
    their first operator in the simulator's priority order (earlier units first: a move there
    changes more of the schedule, and the sweep then meets the schedule as it runs)."""

    def __init__(self, unit_of: np.ndarray, rank: list[int], cost: list[float], memory: list[float]) -> None:
        order = np.argsort(unit_of, kind="stable")
        ptr = np.concatenate([[0], np.cumsum(np.bincount(unit_of))]).tolist()
        flat = order.tolist()
        members = [flat[ptr[c] : ptr[c + 1]] for c in range(len(ptr) - 1)]
        members = [m for m in members if m]
        members.sort(key=lambda m: min(rank[v] for v in m))
        self.members = members
        self.load = [sum(cost[v] for v in m) for m in members]
        self.memory = [sum(memory[v] for v in m) for m in members]
        # by load, lightest first (swap partners: the first that frees enough is the smallest)
        self.by_load = sorted(range(len(members)), key=lambda i: (self.load[i], self.memory[i], i))


def _sweep(state: "_State", level: _Units, finest: _Units | None, budget: int) -> None:
    """One pass over ``level``'s units: each to each other device (or a swap where the caps
    refuse); the first improving target of a unit is kept and the pass goes on."""
    part = state.part
    for i, nodes in enumerate(level.members):
        p = part[nodes[0]]
        if any(part[v] != p for v in nodes):
            continue  # a coarse unit split by earlier moves: its clusters move at finer levels
        for q in state.targets(nodes, p):
            if state.simulations >= budget:
                return
            moves = state.moves_for(nodes, level.load[i], level.memory[i], p, q, finest)
            if moves is not None and state.try_moves(moves):
                part = state.part
                break


class _State:
    """The current partition with its loads, memory, guarded cut and schedule."""

    def __init__(
        self,
        graph: Graph,
        start: np.ndarray,
        k: int,
        cap: float,
        mem_cap: float,
        guarded: np.ndarray | None,
        ceiling: float,
        acyclic: bool,
        shared_links: bool,
    ) -> None:
        self.graph, self.k = graph, k
        self.cap = cap * (1 + 1e-9)
        self.mem_cap = mem_cap
        self.acyclic = acyclic
        self.shared_links = shared_links
        plan = sim_plan(graph)
        self.rank = plan.rank_list
        self.part: list[int] = np.asarray(start, dtype=np.int64).tolist()
        self.cost, self.memory = graph.cost.tolist(), graph.memory.tolist()
        self.load = np.bincount(self.part, weights=graph.cost, minlength=k).tolist()
        self.mem = np.bincount(self.part, weights=graph.memory, minlength=k).tolist()
        self.adj: list[list[int]] = [[] for _ in range(graph.n)]  # neighbours, both directions
        for u, v in zip(graph.src.tolist(), graph.dst.tolist()):
            self.adj[u].append(v)
            self.adj[v].append(u)
        self._on: tuple[int, list[list[int]]] | None = None  # finest units by device, per kept move
        self.guard: list[list[tuple[int, float]]] | None = None
        self.cut = 0.0
        if guarded is not None:
            self.guard = [[] for _ in range(graph.n)]
            hit = np.flatnonzero(np.asarray(guarded) > 0)
            for u, v, w in zip(graph.src[hit].tolist(), graph.dst[hit].tolist(), np.asarray(guarded)[hit].tolist()):
                self.guard[u].append((v, w))
                self.guard[v].append((u, w))
                if self.part[u] != self.part[v]:
                    self.cut += w
        self.ceiling = ceiling
        self.reach = ceiling  # see ``improve``'s ``reach``
        self.simulations = 0
        self.moves = 0
        self.fast = plan.order is not None and not shared_links
        finish = finish_times(graph, np.asarray(self.part), shared_links=shared_links)
        self.span = max(finish, default=0.0)
        if self.fast:
            self.sim = TrialSimulator(graph, k)
            self.sim.set(self.part, finish)
        # the start must meet what every kept move meets, or "never worse" would compare a
        # partition that breaks a constraint with ones that keep it
        self.valid = (
            max(self.load, default=0.0) <= self.cap
            and max(self.mem, default=0.0) <= mem_cap
            and self.cut <= ceiling + 1e-12 * max(abs(ceiling), 1.0)
            and (not acyclic or device_graph_acyclic(graph, np.asarray(self.part), k))
        )

    def assignment(self) -> np.ndarray:
        return np.asarray(self.part, dtype=np.int64)

    def targets(self, nodes: list[int], p: int) -> list[int]:
        """Every other device: the ones the unit's neighbours are on first (by the transfer
        cost a move there saves), then the rest, least loaded first."""
        pull: dict[int, float] = {}
        part = self.part
        for v in nodes:
            for x in self.adj[v]:
                q = part[x]
                if q != p:
                    pull[q] = pull.get(q, 0.0) + 1.0
        near = sorted(pull, key=lambda q: (-pull[q], q))
        rest = sorted((q for q in range(self.k) if q != p and q not in pull), key=lambda q: (self.load[q], q))
        return near + rest

    def moves_for(
        self, nodes: list[int], load_in: float, mem_in: float, p: int, q: int, finest: _Units | None
    ) -> dict[int, int] | None:
        """``nodes`` (all on p; ``load_in`` and ``mem_in`` their sums) to q, or where that breaks
        a cap, with the lightest finest-level unit of q that makes room sent back to p; None when
        neither fits."""
        unlimited = self.mem_cap == float("inf")
        if unlimited:
            mem_in = 0.0
        moves = dict.fromkeys(nodes, q)
        if self.load[q] + load_in <= self.cap and self.mem[q] + mem_in <= self.mem_cap:
            return moves
        if finest is None:
            return None
        need_load = self.load[q] + load_in - self.cap
        need_mem = self.mem[q] + mem_in - self.mem_cap
        fit_load = self.cap - (self.load[p] - load_in)
        fit_mem = self.mem_cap - (self.mem[p] - mem_in)
        if need_load > fit_load or need_mem > fit_mem:
            return None
        on_q = self._units_on(q, finest)
        loads = finest.load
        # the lightest unit of q that frees enough load (and memory) and fits on p
        start = bisect.bisect_left(on_q, need_load, key=loads.__getitem__)
        for j in on_q[start:]:
            wl = loads[j]
            if wl > fit_load:
                return None
            wm = 0.0 if unlimited else finest.memory[j]
            if need_mem <= wm <= fit_mem:
                moves.update(dict.fromkeys(finest.members[j], p))
                return moves
        return None

    def _units_on(self, q: int, finest: _Units) -> list[int]:
        """The finest units wholly on device q, lightest first (listed again after each kept move)."""
        if self._on is None or self._on[0] != self.moves:
            on: list[list[int]] = [[] for _ in range(self.k)]
            part = self.part
            members = finest.members
            for j in finest.by_load:
                m = members[j]
                d = part[m[0]]
                if all(part[v] == d for v in m):
                    on[d].append(j)
            self._on = (self.moves, on)
        return self._on[1][q]

    def try_moves(self, moves: dict[int, int]) -> bool:
        """Simulate the partition with ``moves`` applied; keep it when it meets the guarded
        ceiling and acyclicity and is faster. Whether it was kept."""
        part = self.part
        delta = self._guard_change(moves) if self.guard is not None else 0.0
        eps = 1e-12 * max(abs(self.ceiling), abs(self.cut), 1.0)
        above = self.cut > self.reach + eps  # still getting the cut down to ``reach``
        limit = min(self.ceiling, self.cut if above else self.reach)
        if self.cut + delta > limit + eps:
            return False
        lowers_cut = above and delta < -eps
        trial = list(part)
        for v, d in moves.items():
            trial[v] = d
        if self.acyclic and not device_graph_acyclic(self.graph, np.asarray(trial), self.k):
            return False
        moved = list(moves)
        self.simulations += 1
        if self.fast:
            span, finish = self.sim.run(trial, moved, float("inf") if lowers_cut else self.span)
        else:
            finish = finish_times(self.graph, np.asarray(trial), shared_links=self.shared_links)
            span = max(finish, default=0.0)
        if finish is None or not (lowers_cut or span < self.span * (1 - 1e-12)):
            return False
        for v, d in moves.items():
            old = part[v]
            self.load[old] -= self.cost[v]
            self.load[d] += self.cost[v]
            self.mem[old] -= self.memory[v]
            self.mem[d] += self.memory[v]
        self.part, self.span, self.cut = trial, span, self.cut + delta
        self.moves += 1
        if self.fast:
            self.sim.set(trial, finish, moved)
        return True

    def _guard_change(self, moves: dict[int, int]) -> float:
        """Change of the guarded cut when each operator v in ``moves`` goes to moves[v]."""
        part, adj = self.part, self.guard
        assert adj is not None
        delta = 0.0
        for v, dv in moves.items():
            pv = part[v]
            for x, w in adj[v]:
                if x in moves:
                    if x < v:
                        continue  # counted from x's side
                    dx = moves[x]
                else:
                    dx = part[x]
                delta += w * ((dx != dv) - (part[x] != pv))
        return delta
