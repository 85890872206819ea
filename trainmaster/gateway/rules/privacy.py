"""Disclosure limits on what rules release (item 10): a minimum group size and a privacy budget.

Threat: an initiator may send rules that return aggregates so fine that they rebuild the data (a
histogram with 10,001 edges puts nearly every row in a bin of its own). Two limits, both kept by
the party, which alone sees the rows:

* **minimum group size** ``k``: every non-empty histogram bin, and the rows behind any other
  aggregate result, must number at least ``k``; else the result is refused (not trimmed), with the
  reason.
* **privacy budget** per (party, data set): each call is charged the number of values it releases
  (``release_cost``), in a ledger persisted before the rule runs, and a call that would take the
  data set past its budget is refused. It is charged once per leg (a re-delivered leg is free)
  and whatever the result (a refused result still answered a question).

What it does not do: it is not differential privacy (no noise), it does not stop differencing
between overlapping queries under the budget, and per-row rules (``predict``) are governed only by
the party's allow-list. ``docs/gateway.md`` states this threat model.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import Float, Integer, String, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from trainmaster.gateway.rules.registry import HistogramParams, Params, ScoreParams, SummaryParams, TrainParams


class PrivacyRefusal(Exception):
    """A call refused by a disclosure limit; the message says which limit and what to do."""


def release_cost(rule: str, params: Params, n_columns: int) -> int:
    """How many values a call releases (its charge against the data set's budget)."""
    if isinstance(params, HistogramParams):
        return len(params.edges) - 1
    if isinstance(params, SummaryParams):
        return 7 * (len(params.columns) if params.columns is not None else n_columns)
    if isinstance(params, TrainParams):
        d = len(params.features)
        return d + 1 if params.model == "logreg" else d * params.hidden + 2 * params.hidden + 1
    if isinstance(params, ScoreParams):
        return 3
    return 1


def check_group_sizes(rule: str, result: dict[str, Any], k: int) -> None:
    """Refuse a result that describes fewer than ``k`` rows in any group it reports."""
    if rule == "histogram":
        small = [i for i, c in enumerate(result.get("counts", [])) if 0 < c < k]
        if small:
            raise PrivacyRefusal(
                f"histogram bin(s) {small[:10]}{'...' if len(small) > 10 else ''} hold fewer than "
                f"{k} rows (the party's minimum group size); use wider bins"
            )
    elif rule == "summary_stats":
        small = sorted(c for c, s in result.get("columns", {}).items() if s.get("count", 0) < k)
        if small:
            raise PrivacyRefusal(
                f"column(s) {small[:10]} summarise fewer than {k} rows (the party's minimum group size)"
            )
    elif "rows" in result and rule in ("train", "score") and result["rows"] < k:
        raise PrivacyRefusal(f"{rule} over {result['rows']} rows is below the party's minimum group size {k}")


class _Base(DeclarativeBase):
    pass


class BudgetCharge(_Base):
    __tablename__ = "privacy_charges"
    task_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    data_id: Mapped[str] = mapped_column(String(64), primary_key=True, index=True)
    cost: Mapped[int] = mapped_column(Integer)
    charged_at: Mapped[float] = mapped_column(Float)


class PrivacyLedger:
    """Per data set, the values released so far; one charge per leg, committed before the rule runs."""

    def __init__(self, url: str):
        from trainmaster.gateway.store import make_sessionmaker

        self._sessions = make_sessionmaker(url, _Base.metadata)

    def charge(self, task_id: str, data_id: str, cost: int, budget: int) -> int:
        """Charge the leg (once) and return what the data set has used; refuse past ``budget``."""
        with self._sessions.begin() as s:
            if s.get(BudgetCharge, (task_id, data_id)) is not None:
                return self.used(data_id)
            used = sum(s.scalars(select(BudgetCharge.cost).where(BudgetCharge.data_id == data_id)).all())
            if used + cost > budget:
                raise PrivacyRefusal(
                    f"privacy budget of data set {data_id!r} exhausted: this call releases {cost} "
                    f"value(s), {used} of {budget} are used; ask the party to raise privacy_budget "
                    "or release fewer values (coarser bins, fewer columns)"
                )
            s.add(BudgetCharge(task_id=task_id, data_id=data_id, cost=cost, charged_at=time.time()))
            return used + cost

    def used(self, data_id: str) -> int:
        with self._sessions() as s:
            return sum(s.scalars(select(BudgetCharge.cost).where(BudgetCharge.data_id == data_id)).all())
