"""Makespan-directed local search: move the clusters that the schedule's critical chain runs through.

Why not just the partition-aware slack: that slack ignores device contention (each device runs one
operator at a time), and the simulated makespan is what the user waits for. The simulator's
schedule names, for the operator that finishes last, what held each operator back: a predecessor's
data arriving from another device (a transfer on the chain) or its device being busy with the
operator before it. Moving a cluster across such a link removes that transfer or that wait. Moves
are tried for the co-location cluster of an endpoint and for the chain segment (coarse cluster)
holding it, first improvement wins, and the work is capped by a number of simulations so the
search costs a fixed multiple of one simulation whatever the graph's size.
"""

from __future__ import annotations

import numpy as np

from trainmaster.partition.critical import levels
from trainmaster.partition.graph import Graph
from trainmaster.partition.simulate import (
    TrialSimulator,
    device_graph_acyclic,
    predecessor_lists,
    schedule,
    sim_plan,
    static_order,
)


def critical_chain(
    graph: Graph,
    assignment: np.ndarray | list[int],
    finish: list | None = None,
) -> tuple[float, list[tuple[int, int, bool]]]:
    """The schedule's makespan and its critical chain as (u, v, transfer) links, last first:
    ``transfer`` True when v waited for u's data from another device, False when v waited for its
    device to finish u. ``finish``: the schedule's finish times when already simulated."""
    order = static_order(graph)
    if finish is not None and order is not None and graph.n:
        chain = _static_chain(graph, order, assignment, finish)
        if chain is not None:
            return chain
    if finish is None:
        start_a, finish_a = schedule(graph, np.asarray(assignment))
    else:
        finish_a = np.asarray(finish)
        start_a = finish_a - graph.cost
    if graph.n == 0:
        return 0.0, []
    part = np.asarray(assignment)
    # per device, in execution order: by start, ties (zero-cost operators) by scheduling priority
    by_device = np.lexsort((_priority_rank(graph), finish_a, start_a, part))
    prev_on_dev = np.full(graph.n, -1, dtype=np.int64)
    same = part[by_device[1:]] == part[by_device[:-1]]
    prev_on_dev[by_device[1:][same]] = by_device[:-1][same]
    v = int(np.argmax(finish_a))
    links = _walk_back(graph, v, finish_a.tolist(), start_a.tolist(), part.tolist(), prev_on_dev.tolist())
    return float(finish_a[v]), links


def _static_chain(
    graph: Graph,
    order: list[int],
    assignment,
    finish: list,
) -> tuple[float, list[tuple[int, int, bool]]] | None:
    """``critical_chain`` for a schedule the simulator walked in its static priority order, on
    plain lists: there each device runs its operators in that order (a later one starts no
    earlier than the one before it ends), which is the (start, finish, priority) order the
    general case sorts by, so the operator before v on its device is the one before it in the
    order. Same links, without the sort. Start times are recomputed as finish - cost, as the
    general case does, and can then be an ulp out of order (an operator that starts when a
    zero-cost one ends); the order is checked and None returned (sort instead) if it is not
    exactly the sorted one."""
    part = assignment if isinstance(assignment, list) else np.asarray(assignment).tolist()
    fin = finish if isinstance(finish, list) else np.asarray(finish).tolist()
    w = sim_plan(graph).cost
    prev = [-1] * graph.n
    last = [-1] * (max(part) + 1)
    # v starts no earlier than u (before it on its device) ends, so the recomputed starts can
    # only swap when u's cost is within rounding of nothing: fl(f_u - w_u) >= fl(f_v - w_v)
    # needs w_u <= ~1.5 ulp(f_v) <= 4e-16 f_v; costs above 1e-12 x the makespan are not checked
    small = 1e-12 * max(fin)
    for v in order:
        d = part[v]
        u = last[d]
        if u >= 0 and w[u] <= small:
            su, sv = fin[u] - w[u], fin[v] - w[v]
            if su > sv or (su == sv and fin[u] > fin[v]):
                return None  # the sort would put v before u on their device
        prev[v] = u
        last[d] = v
    span = max(fin)
    return float(span), _walk_back(graph, fin.index(span), fin, None, part, prev)


def _walk_back(
    graph: Graph, v: int, fin: list, start: list | None, part: list, prev: list
) -> list[tuple[int, int, bool]]:
    """The critical chain ending at ``v``, last link first: from each operator back to the
    predecessor whose data (or, on the same device, whose end) it waited for, else to the
    operator before it on its device (``prev``). ``start`` None: start = finish - cost."""
    w: list[float] = sim_plan(graph).cost if start is None else []
    tol = 1e-9 * max(fin[v], 1.0)
    links: list[tuple[int, int, bool]] = []
    append = links.append
    preds = predecessor_lists(graph)
    for _ in range(graph.n):  # each step goes back in time or in priority: at most n steps
        sv = fin[v] - w[v] if start is None else start[v]
        if sv <= tol:
            break
        nxt, transfer = -1, False
        pv = part[v]
        ready = sv - tol
        for u, c in preds[v]:
            cut = part[u] != pv
            if fin[u] + (c if cut else 0.0) >= ready:
                nxt, transfer = u, cut and c > 0
                break
        if nxt < 0:
            nxt = prev[v]
            if nxt < 0:
                break
        append((nxt, v, transfer))
        v = nxt
    return links


def _priority_rank(graph: Graph) -> np.ndarray:
    rank = graph.cache.get("priority_rank")
    if rank is None:
        order = np.lexsort((np.arange(graph.n), -levels(graph).blevel))
        rank = np.empty(graph.n, dtype=np.int64)
        rank[order] = np.arange(graph.n)
        graph.cache["priority_rank"] = rank
    return rank


def makespan_descent(
    graph: Graph,
    part: np.ndarray,
    k: int,
    cap: float,
    mem_cap: float,
    units: list[np.ndarray],
    budget: int,
    acyclic: bool = False,
    guarded: np.ndarray | None = None,
    swaps: bool = False,
    finish: list | None = None,
) -> tuple[np.ndarray, float, int]:
    """First-improvement descent on the simulated makespan within the caps.

    ``units`` are nested node -> unit maps, finest first (co-location clusters, then chain
    segments made of them);
    a move sends one whole unit to the device on the other side of a critical-chain link.
    ``guarded`` (per-edge weights, e.g. transfer cost on static critical edges) makes the
    descent refuse moves that raise the guarded cut: makespan improves without paying for it
    in critical edges. ``swaps`` (for tight caps): a move the caps refuse sends the smallest
    co-location cluster of the target device that makes room back to the mover's device
    instead (``_MoveCheck._swap``). ``finish``: the schedule of ``part`` when already
    simulated. Returns (assignment, makespan, simulations used)."""
    state = _MoveCheck(graph, part, k, cap, mem_cap, guarded, acyclic, units[0] if swaps else None, finish)
    span, links = critical_chain(graph, state.part_l, state.finish)
    members = [_Members(u) for u in units]
    member_order = [m.order for m in members]  # unit c of level lvl: order[ptr[c]:ptr[c + 1]]
    member_ptr = [m.ptr for m in members]
    unit_of = [np.asarray(u).tolist() for u in units]
    sizes = [np.bincount(u).tolist() for u in units]
    preds = predecessor_lists(graph)
    # a move (unit c of level lvl to device q) is keyed by the int (c * k + q) * levels + lvl
    levels = len(units)
    tried: set[int] = set()  # moves refused or not better since the last gain
    refused: dict[int, int] = {}  # refused moves and why (_CAPS or _GUARD)
    # per operator, its distinct units: (key of the move to device 0, members' order list,
    # slice bounds); a unit with as many nodes as the finer one holds the same nodes (units
    # nest), so it is left out. Static: made once per operator the chains name.
    units_at: dict[int, list[tuple[int, list[int], int, int]]] = {}

    def units_of(v: int) -> list[tuple[int, list[int], int, int]]:
        out, size = [], 0
        for lvl, of in enumerate(unit_of):
            c = of[v]
            if sizes[lvl][c] == size:
                continue
            size = sizes[lvl][c]
            ptr = member_ptr[lvl]
            out.append((c * k * levels + lvl, member_order[lvl], ptr[c], ptr[c + 1]))
        units_at[v] = out
        return out

    part_l = state.part_l
    used = 0
    while used < budget:
        improved = False
        for mover, targets in _moves(links, state, preds):
            here = part_l[mover]
            for key0, order_l, lo, hi in units_at.get(mover) or units_of(mover):
                for q in targets:
                    key = key0 + q * levels  # (c * k + q) * levels + lvl
                    if q == here or key in tried or key in refused:
                        continue
                    trial = state.trial(order_l[lo:hi], q)
                    if not isinstance(trial, tuple):
                        refused[key] = trial
                        continue
                    tried.add(key)
                    if used >= budget:
                        return state.part, span, used
                    used += 1
                    # stops early (inf) once it provably cannot beat ``span``
                    s, finish = state.sim.run(trial[0], trial[1], span)
                    if s < span - 1e-9 * max(span, 1.0):
                        assert finish is not None  # a completed trial has its schedule
                        sources = {part_l[v] for v in trial[1]}
                        touched = sources | {trial[0][v] for v in trial[1]}
                        state.accept(trial[0], finish, trial[1])
                        part_l = state.part_l
                        span, links = critical_chain(graph, state.part_l, finish)
                        tried.clear()
                        refused = _still_refused(refused, trial[1], sources, touched, unit_of, state)
                        improved = True
                        break
                if improved:
                    break
            if improved:
                break
        if not improved:
            break
    return state.part, span, used


def _still_refused(
    refused: dict, moved: list[int], sources: set[int], devices: set[int], unit_of: list[list[int]], state: "_MoveCheck"
) -> dict:
    """The refusals an accepted move (``moved`` operators, from the ``sources`` devices; all
    the ``devices`` it touched) cannot have lifted, so the descent need not check them again:
    a move refused for the caps stays refused unless its target lost load (a source) or its unit
    lost or gained operators (it holds a moved one); one refused by the guard stays refused
    unless a moved operator is in its unit or next to it by a guarded edge (nothing else enters
    the guarded cut's change); an acyclicity refusal may be lifted by any move. A refused swap
    (``(_SWAP, p)``: no partner on the target fits) is checked again once its unit, its device
    p or its target changed (that is all a partner's choice reads, but for the guard)."""
    touched = [{of[v] for v in moved} for of in unit_of]
    near = moved
    if state.guarded_adj is not None:
        near = list(moved) + [x for v in moved for x, _ in state.guarded_adj[v]]
    near_units = [{of[v] for v in near} for of in unit_of]
    kept = {}
    k, levels = state.k, len(unit_of)
    for key, why in refused.items():
        lvl, cq = key % levels, key // levels
        c, q = divmod(cq, k)
        if why == _CAPS:
            if q not in sources and c not in touched[lvl]:
                kept[key] = why
        elif why == _GUARD:
            if c not in near_units[lvl]:
                kept[key] = why
        elif why < 0:  # a swap refused on device p = -1 - why
            if q not in devices and -1 - why not in devices and c not in near_units[lvl]:
                kept[key] = why
    return kept


def _moves(links: list[tuple[int, int, bool]], state: "_MoveCheck", preds: list[list[tuple[int, float]]]):
    """(mover, target devices) along the chain: across a transfer, each endpoint to the other's
    device; for a device wait, each endpoint to the least loaded other devices. Transfers come
    first, costliest first; then device waits, latest first (the chain's order). Each pair
    once: an operator on two links of the chain would repeat moves already tried. A generator:
    the descent stops at the first improving move (after about an eighth of the pairs on the
    synthetic graphs), so the device-wait pairs are made as they are asked for; the state does
    not change while it runs (the descent leaves the loop when it accepts a move)."""
    part, load, k = state.part_l, state.load, state.k
    transfers = []
    for u, v, transfer in links:
        if transfer:
            top = None  # the link's cost: the max over parallel edges u -> v
            for p, c in preds[v]:
                if p == u and (top is None or c > top):
                    top = c
            transfers.append((0.0 if top is None else top, u, v))
    transfers.sort(key=lambda t: -t[0])  # stable: equal costs keep the chain's order
    seen: set[tuple[int, tuple[int, ...]]] = set()
    pair: tuple[int, tuple[int, ...]]
    for _, u, v in transfers:
        for pair in ((v, (part[u],)), (u, (part[v],))):
            if pair not in seen:
                seen.add(pair)
                yield pair
    others = [tuple(_other_parts(p, load, k)) for p in range(k)]
    for u, v, transfer in links:
        if not transfer:
            pair = (v, others[part[v]])
            if pair not in seen:
                seen.add(pair)
                yield pair
            pair = (u, others[part[u]])
            if pair not in seen:
                seen.add(pair)
                yield pair


_CAPS, _GUARD, _CYCLE, _SWAP = 1, 2, 3, 4  # why a trial move was refused
_INF = float("inf")


class _MoveCheck:
    """The current assignment with its loads, memory and guarded cut; ``trial`` builds a moved
    copy when it keeps the caps, the guarded cut and (if asked) an acyclic device graph."""

    def __init__(
        self,
        graph: Graph,
        part: np.ndarray,
        k: int,
        cap: float,
        mem_cap: float,
        guarded: np.ndarray | None,
        acyclic: bool,
        swap_units: np.ndarray | None = None,
        finish: list | None = None,
    ) -> None:
        self.graph, self.k, self.cap, self.mem_cap = graph, k, cap, mem_cap
        self.acyclic = acyclic
        self.swap_units = None if swap_units is None else _SwapUnits(graph, swap_units, cap, mem_cap)
        self.guarded_adj = None if guarded is None else _weighted_adjacency(graph, guarded)
        self.cost, self.memory = graph.cost.tolist(), graph.memory.tolist()
        self.sim = TrialSimulator(graph, k)
        part = np.asarray(part, dtype=np.int64).copy()
        if finish is None:
            finish = schedule(graph, part)[1].tolist()
        self.accept(part.tolist(), list(finish))

    def accept(self, part: list[int], finish: list, moved: list[int] | None = None) -> None:
        """The new assignment and its schedule; ``moved``: the operators a trial moved (its
        simulator checkpoints before the first of them are kept)."""
        self.part_l, self.finish = part, finish
        self.sim.set(part, finish, moved)
        self.part = np.asarray(part, dtype=np.int64)
        self.load = np.bincount(self.part, weights=self.graph.cost, minlength=self.k).tolist()
        self.mem = np.bincount(self.part, weights=self.graph.memory, minlength=self.k).tolist()
        if self.swap_units is not None:
            self.swap_units.place(self.part, self.k)

    def trial(self, nodes: list[int], q: int) -> tuple[list[int], list[int]] | int:
        """(moved assignment, operators that changed device), or why it was refused
        (``_CAPS``, ``_GUARD``, ``_CYCLE``). Most trials are refused, so the checks run on
        Python lists before any array is built."""
        part, cost, mem = self.part_l, self.cost, self.memory
        moving = []
        load_in = mem_in = 0.0  # summed in node order, as sum() would (no comprehensions: in
        for v in nodes:  # Python 3.11 each is a call, and most units are one operator)
            if part[v] != q:
                moving.append(v)
                load_in += cost[v]
                mem_in += mem[v]
        if self.mem_cap == _INF:
            mem_in = 0.0
        if self.load[q] + load_in > self.cap * (1 + 1e-9) or self.mem[q] + mem_in > self.mem_cap:
            if self.swap_units is None:
                return _CAPS
            return self._swap(moving, q, load_in, mem_in)
        if self.guarded_adj is not None and self._guard_delta(moving, q) > 1e-12:
            return _GUARD
        trial = list(part)
        for v in moving:
            trial[v] = q
        if self.acyclic and not device_graph_acyclic(self.graph, np.asarray(trial), self.k):
            return _CYCLE
        return trial, moving

    def _swap(self, moving: list[int], q: int, load_in: float, mem_in: float) -> tuple[list[int], list[int]] | int:
        """The move of ``moving`` (all on one device p) to q that breaks a cap, made room for
        by sending one co-location cluster from q back to p: the one that frees enough on q,
        fits on p, and is the smallest share of the caps (the least disruptive). Refused
        (``-1 - p``) when there is none or the pair breaks the guard; ``_SWAP`` when the unit
        spans devices or the pair makes the device graph cyclic."""
        part = self.part_l
        sources = {part[v] for v in moving}
        if len(sources) != 1:
            return _SWAP
        p = sources.pop()
        refused = -1 - p  # the refusal, remembered with the device it read
        room = self.cap * (1 + 1e-9)
        need_load = self.load[q] + load_in - room
        need_mem = self.mem[q] + mem_in - self.mem_cap
        fit_load = room - (self.load[p] - load_in)
        fit_mem = self.mem_cap - (self.mem[p] - mem_in)
        su = self.swap_units
        assert su is not None  # _swap is only called with swap units
        if need_load > fit_load or need_mem > fit_mem or need_load > su.top_load[q] or need_mem > su.top_memory[q]:
            return refused  # no cluster on q is big enough, or none could be both
        # q's clusters by (share, index): the first that frees enough and fits is the pick
        load_l, mem_l = su.load_l, su.memory_l
        for pick in su.by_share_on[q]:
            if need_load <= load_l[pick] <= fit_load and need_mem <= mem_l[pick] <= fit_mem:
                break
        else:
            return refused
        back = su.members[pick]
        moves = {v: q for v in moving}
        moves.update((v, p) for v in back)
        if self.guarded_adj is not None and self._guard_change(moves) > 1e-12:
            return refused
        trial = list(part)
        for v, d in moves.items():
            trial[v] = d
        if self.acyclic and not device_graph_acyclic(self.graph, np.asarray(trial), self.k):
            return _SWAP
        return trial, moving + back

    def _guard_change(self, moves: dict[int, int]) -> float:
        """Change of the guarded cut when each operator v in ``moves`` goes to moves[v]."""
        part, adj = self.part_l, self.guarded_adj
        assert adj is not None  # called only when moves are guarded
        delta = 0.0
        for v, dv in moves.items():
            pv = part[v]
            for x, w in adj[v]:
                if x in moves:
                    if x < v:
                        continue  # that edge was counted from x's side
                    dx = moves[x]
                else:
                    dx = part[x]
                delta += w * ((dx != dv) - (part[x] != pv))
        return delta

    def _guard_delta(self, moving: list[int], q: int) -> float:
        """Change of the guarded cut when ``moving`` go to q (only their own edges change)."""
        part, adj = self.part_l, self.guarded_adj
        assert adj is not None  # called only when moves are guarded
        delta = 0.0
        if len(moving) == 1:  # most units are one operator (no self-loops: no edge inside)
            v = moving[0]
            pv = part[v]
            for x, w in adj[v]:
                delta += w * ((part[x] != q) - (part[x] != pv))
            return delta
        inside = set(moving)
        for v in moving:
            pv = part[v]
            for x, w in adj[v]:
                if x in inside:
                    continue  # both ends move together: that edge's cut state is unchanged
                delta += w * ((part[x] != q) - (part[x] != pv))
        return delta


def _weighted_adjacency(graph: Graph, weights: np.ndarray) -> list[list[tuple[int, float]]]:
    """Per node, (neighbour, weight) of its edges with a positive weight, both directions."""
    adj: list[list[tuple[int, float]]] = [[] for _ in range(graph.n)]
    hit = np.flatnonzero(weights > 0)
    for u, v, w in zip(graph.src[hit].tolist(), graph.dst[hit].tolist(), weights[hit].tolist()):
        adj[u].append((v, w))
        adj[v].append((u, w))
    return adj


class _SwapUnits:
    """Co-location clusters as swap partners: load, memory, share of the caps, members and
    the device each is on (a cluster never straddles devices)."""

    def __init__(self, graph: Graph, unit_of: np.ndarray, cap: float, mem_cap: float) -> None:
        unit_of = np.asarray(unit_of)
        self.load = np.bincount(unit_of, weights=graph.cost)
        self.memory = np.bincount(unit_of, weights=graph.memory)
        share = self.load / max(cap, 1e-300)
        if np.isfinite(mem_cap) and mem_cap > 0:
            share = share + self.memory / mem_cap
        self.share = share
        self.load_l, self.memory_l = self.load.tolist(), self.memory.tolist()
        self.by_share = np.lexsort((np.arange(len(share)), share)).tolist()
        self.by_share_on: list[list[int]] = []
        members = _Members(unit_of)
        self.members = [members[c] for c in range(len(self.load))]
        self.first = np.asarray([m[0] for m in self.members], dtype=np.int64)
        self.device = np.zeros(len(self.load), dtype=np.int64)
        self.top_load: list[float] = []
        self.top_memory: list[float] = []

    def place(self, part: np.ndarray, k: int) -> None:
        """Each cluster's device, and the largest cluster load and memory on each device."""
        self.device = part[self.first]
        top_load, top_memory = np.zeros(k), np.zeros(k)
        np.maximum.at(top_load, self.device, self.load)
        np.maximum.at(top_memory, self.device, self.memory)
        self.top_load, self.top_memory = top_load.tolist(), top_memory.tolist()
        device = self.device.tolist()
        self.by_share_on = [[] for _ in range(k)]
        for c in self.by_share:
            self.by_share_on[device[c]].append(c)


class _Members:
    """Nodes of each unit, sliced on demand from one sort (no per-unit arrays up front)."""

    def __init__(self, unit_of: np.ndarray) -> None:
        self.order = np.argsort(unit_of, kind="stable").tolist()
        self.ptr = np.concatenate([[0], np.cumsum(np.bincount(unit_of))]).tolist()

    def __getitem__(self, c: int) -> list[int]:
        return self.order[self.ptr[c] : self.ptr[c + 1]]


def _other_parts(p: int, load: list[float], k: int) -> list[int]:
    """For a device wait: the least loaded other device first (at most two tried)."""
    return sorted((q for q in range(k) if q != p), key=load.__getitem__)[:2]
