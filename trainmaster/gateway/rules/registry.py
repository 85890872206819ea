"""The processing-rule registry: named, parameter-validated operations a party allows.

An initiator names a rule and gives parameters; each rule's parameter model is strict
(``extra="forbid"``), so there is no field through which code could be sent. Results are built
from sums and counts where possible, so an initiator can pool several parties' results exactly.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainmaster.gateway.models import RuleCall

COLUMN = Field(pattern=r"^[A-Za-z0-9_ .-]{1,64}$")


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")


Table = dict[str, np.ndarray]


def load_table(path: Path, source: BinaryIO | None = None) -> Table:
    """The party's own data file: CSV (header row of column names, numeric cells) or Parquet.

    ``source``, when given, is the file already open (a sandboxed executor gets the descriptor,
    never the path); ``path`` then only names it and says its format.
    """
    if path.suffix == ".parquet":
        return _load_parquet(path, source)
    with io.TextIOWrapper(source, newline="") if source is not None else path.open(newline="") as fh:
        reader = csv.reader(fh)
        names = next(reader)
        data = np.array([[float(x) for x in row] for row in reader if row], dtype=np.float64)
    if data.size == 0:
        data = np.zeros((0, len(names)))
    return {n: data[:, i] for i, n in enumerate(names)}


def _load_parquet(path: Path, source: BinaryIO | None = None) -> Table:
    """Columnar load via pyarrow (imported here: only executors that hold Parquet files need it)."""
    import pyarrow.parquet as pq

    table = pq.read_table(source if source is not None else path)
    out: Table = {}
    for name, col in zip(table.column_names, table.columns):
        if col.null_count:
            raise RuleError(f"column {name!r} of {path.name} has missing values; rules need numeric cells")
        try:
            out[name] = col.to_numpy().astype(np.float64)
        except (TypeError, ValueError) as exc:
            raise RuleError(f"column {name!r} of {path.name} is not numeric ({col.type})") from exc
    return out


class RuleError(Exception):
    """A rule call the party refuses (unknown rule, bad parameters, unknown column)."""


def _cols(t: Table, names: list[str] | None) -> list[str]:
    names = list(t) if names is None else names
    missing = [n for n in names if n not in t]
    if missing:
        raise RuleError(f"unknown column(s): {missing}")
    return names


class RowCountParams(Params):
    pass


def row_count(t: Table, p: RowCountParams) -> dict[str, Any]:
    return {"rows": int(len(next(iter(t.values())))) if t else 0}


class SummaryParams(Params):
    columns: list[str] | None = Field(default=None, max_length=4096)


def summary_stats(t: Table, p: SummaryParams) -> dict[str, Any]:
    """Per column: count, sum, sum of squares, min, max, mean, std (sums make pooling exact)."""
    out = {}
    for c in _cols(t, p.columns):
        x = t[c]
        out[c] = {
            "count": int(x.size),
            "sum": float(x.sum()),
            "sumsq": float(np.square(x).sum()),
            "min": float(x.min()) if x.size else None,
            "max": float(x.max()) if x.size else None,
            "mean": float(x.mean()) if x.size else None,
            "std": float(x.std()) if x.size else None,
        }
    return {"columns": out}


class HistogramParams(Params):
    column: str
    edges: list[float] = Field(min_length=2, max_length=10_001)


def histogram(t: Table, p: HistogramParams) -> dict[str, Any]:
    """Counts over initiator-chosen edges, so every party bins the same way and counts add up."""
    edges = np.asarray(p.edges)
    if np.any(np.diff(edges) <= 0):
        raise RuleError("histogram edges must be strictly increasing")
    counts, _ = np.histogram(t[_cols(t, [p.column])[0]], bins=edges)
    return {"column": p.column, "edges": p.edges, "counts": counts.tolist()}


class TrainParams(Params):
    features: list[str] = Field(min_length=1, max_length=1024)
    label: str
    model: str = Field(default="logreg", pattern=r"^(logreg|mlp)$")
    hidden: int = Field(default=16, ge=1, le=256)
    epochs: int = Field(default=100, ge=1, le=10_000)
    lr: float = Field(default=0.1, gt=0, le=10)
    l2: float = Field(default=0.0, ge=0)
    seed: int = 0
    standardize: dict[str, list[float]] | None = None
    init: dict[str, Any] | None = None


def _xy(
    t: Table, features: list[str], label: str, standardize: dict[str, list[float]] | None
) -> tuple[np.ndarray, np.ndarray]:
    _cols(t, [*features, label])
    x = np.stack([t[f] for f in features], axis=1)
    if standardize is not None:
        x = (x - np.asarray(standardize["mean"])) / np.asarray(standardize["std"])
    return x, t[label]


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -40, 40)))


def _forward(weights: dict[str, Any], x: np.ndarray) -> np.ndarray:
    if "w1" in weights:
        h = np.tanh(x @ np.asarray(weights["w1"]) + np.asarray(weights["b1"]))
        return _sigmoid(h @ np.asarray(weights["w2"]) + float(weights["b2"]))
    return _sigmoid(x @ np.asarray(weights["w"]) + float(weights["b"]))


def train(t: Table, p: TrainParams) -> dict[str, Any]:
    """Full-batch gradient descent on the party's rows; returns weights and the row count (for FedAvg)."""
    x, y = _xy(t, p.features, p.label, p.standardize)
    n, d = x.shape
    rng = np.random.default_rng(p.seed)
    if p.model == "logreg":
        w = np.asarray(p.init["w"]) if p.init else np.zeros(d)
        b = float(p.init["b"]) if p.init else 0.0
        for _ in range(p.epochs):
            g = _sigmoid(x @ w + b) - y
            w = w - p.lr * (x.T @ g / n + p.l2 * w)
            b -= p.lr * float(g.mean())
        weights: dict[str, Any] = {"w": w.tolist(), "b": b}
    else:
        w1 = np.asarray(p.init["w1"]) if p.init else rng.normal(0, 1 / np.sqrt(d), (d, p.hidden))
        b1 = np.asarray(p.init["b1"]) if p.init else np.zeros(p.hidden)
        w2 = np.asarray(p.init["w2"]) if p.init else rng.normal(0, 1 / np.sqrt(p.hidden), p.hidden)
        b2 = float(p.init["b2"]) if p.init else 0.0
        for _ in range(p.epochs):
            h = np.tanh(x @ w1 + b1)
            g = _sigmoid(h @ w2 + b2) - y
            gh = np.outer(g, w2) * (1 - h * h)
            w2 = w2 - p.lr * (h.T @ g / n + p.l2 * w2)
            b2 -= p.lr * float(g.mean())
            w1 = w1 - p.lr * (x.T @ gh / n + p.l2 * w1)
            b1 = b1 - p.lr * gh.mean(axis=0)
        weights = {"w1": w1.tolist(), "b1": b1.tolist(), "w2": w2.tolist(), "b2": b2}
    return {"model": p.model, "weights": weights, "rows": int(n)}


class ScoreParams(Params):
    features: list[str] = Field(min_length=1, max_length=1024)
    label: str
    weights: dict[str, Any]
    standardize: dict[str, list[float]] | None = None


def score(t: Table, p: ScoreParams) -> dict[str, Any]:
    """Accuracy and log-loss of a given model on the party's rows, as sums so they pool exactly."""
    x, y = _xy(t, p.features, p.label, p.standardize)
    prob = np.clip(_forward(p.weights, x), 1e-12, 1 - 1e-12)
    correct = int(((prob >= 0.5) == (y >= 0.5)).sum())
    logloss_sum = float(-(y * np.log(prob) + (1 - y) * np.log(1 - prob)).sum())
    return {"rows": int(y.size), "correct": correct, "logloss_sum": logloss_sum}


class PredictParams(Params):
    features: list[str] = Field(min_length=1, max_length=1024)
    weights: dict[str, Any]
    standardize: dict[str, list[float]] | None = None


def predict(t: Table, p: PredictParams) -> dict[str, Any]:
    """A given model's probability for every one of the party's rows, in row order.

    The result grows with the data (tens of MB for millions of rows: it travels as a chunked
    stream), and it is one number per row, which can disclose row values (a one-feature linear
    model is invertible); so it is not allowed unless a party lists it in ``allowed_rules``.
    """
    _cols(t, p.features)
    x = np.stack([t[f] for f in p.features], axis=1)
    if p.standardize is not None:
        x = (x - np.asarray(p.standardize["mean"])) / np.asarray(p.standardize["std"])
    return {"rows": int(x.shape[0]), "predictions": _forward(p.weights, x).tolist()}


STREAM_BLOCK = 1 << 20
"""Bytes a stream rule reads of its input at a time (a multiple of every element size)."""


class ScaleParams(Params):
    factor: float = Field(allow_inf_nan=False)


def scale_params(_t: Table, p: ScaleParams, source: BinaryIO, write: Callable[[bytes | memoryview], None]) -> None:
    """Every parameter of the leg's input (little-endian float32, any size) times ``factor``, one
    block at a time: a stand-in for a local training step over a model too large to hold, which
    reads and writes every parameter once (as the trainer of NVIDIA FLARE's large-model test does).
    It releases nothing of the party's data; like ``predict`` it runs only where a party lists it
    in ``allowed_rules``."""
    block = bytearray(STREAM_BLOCK)
    out = np.empty(STREAM_BLOCK // 4, dtype="<f4")
    factor = np.float32(p.factor)
    while n := source.readinto(block):  # type: ignore[attr-defined]
        if n % 4:
            rest = source.read(4 - n % 4)
            if n + len(rest) != n - n % 4 + 4:
                raise RuleError("the input is not a whole number of float32 values")
            block[n : n + len(rest)] = rest
            n += len(rest)
        values = np.frombuffer(memoryview(block)[:n], dtype="<f4")
        np.multiply(values, factor, out=out[: values.size])
        write(out[: values.size].data.cast("B"))


StreamRun = Callable[[Table, Any, BinaryIO, Callable[[bytes | memoryview], None]], None]


@dataclass(frozen=True)
class Rule:
    name: str
    params: type[Params]
    run: Callable[[Table, Any], dict[str, Any]] | None = None
    """A rule whose result is one JSON object."""
    stream: StreamRun | None = None
    """A rule that reads the leg's input and writes its result as it goes (any size, bounded memory)."""
    default_allowed: bool = True
    """False: only a party whose ``allowed_rules`` names the rule runs it (per-row disclosure)."""

    @property
    def needs_input(self) -> bool:
        return self.stream is not None


REGISTRY: dict[str, Rule] = {
    r.name: r
    for r in [
        Rule("row_count", RowCountParams, row_count),
        Rule("summary_stats", SummaryParams, summary_stats),
        Rule("histogram", HistogramParams, histogram),
        Rule("train", TrainParams, train),
        Rule("score", ScoreParams, score),
        Rule("predict", PredictParams, predict, default_allowed=False),
        Rule("scale_params", ScaleParams, stream=scale_params, default_allowed=False),
    ]
}


def validate_call(call: RuleCall, allowed: list[str] | None = None) -> Params:
    """Resolve a call against the registry (and the party's allow-list); refuse anything else."""
    rule = REGISTRY.get(call.rule)
    permitted = allowed if allowed is not None else [r.name for r in REGISTRY.values() if r.default_allowed]
    if rule is None or call.rule not in permitted:
        raise RuleError(f"rule {call.rule!r} is not registered at this party (allowed: {sorted(permitted)})")
    try:
        return rule.params.model_validate(call.params)
    except ValidationError as exc:
        raise RuleError(
            f"invalid parameters for rule {call.rule!r}: "
            + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
        ) from exc


def run_call(t: Table, call: RuleCall, allowed: list[str] | None = None) -> dict[str, Any]:
    """A JSON rule's result (a stream rule runs through ``executors.base.run_rule``)."""
    params = validate_call(call, allowed)
    run = REGISTRY[call.rule].run
    if run is None:
        raise RuleError(f"rule {call.rule!r} reads an input and streams its result; it has no JSON result")
    return run(t, params)
