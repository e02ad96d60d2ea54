"""Storage pricing: the cheapest profiled location whose loading still hides recompute.

Loading adds nothing to time to first token while ``T_load(L) <= T_recompute(r, L)``
(:mod:`kvblend.tuning.delay`), so among the locations `kvblend profile` measured
and the user priced ($/GB-month), the cheapest such one is the right tier for
the archive. No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from kvblend.errors import UsageError
from kvblend.tuning.delay import CostModel, recompute_time
from kvblend.tuning.jsonable import from_fields
from kvblend.tuning.profile import Profile

#: What `tune --storage-costs` prices when not told: rough cloud list prices, $ per GB-month.
DEFAULT_STORAGE_COSTS = "ram=5,nvme=0.1,hdd=0.02"


@dataclass
class StorageOption:
    label: str
    price_per_GB_month: float
    t_load_s: float
    t_recompute_s: float
    hides: bool  # loading adds no delay: T_load ≤ T_recompute(ratio)
    monthly_cost: float | None = None
    profile: str | None = None


@dataclass
class StorageDecision:
    choice: StorageOption | None
    candidates: list[StorageOption] = field(default_factory=list)
    unprofiled: list[str] = field(default_factory=list)  # priced labels with no profile on this machine

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StorageDecision:
        choice = d.get("choice")
        return cls(
            from_fields(StorageOption, choice) if choice else None,
            [from_fields(StorageOption, c) for c in d.get("candidates", [])],
            list(d.get("unprofiled", [])),
        )


def latest_by_label(profiles: Iterable[Profile]) -> dict[str, Profile]:
    """The most recent profile of each storage label."""
    best: dict[str, Profile] = {}
    for p in profiles:
        label = p.storage.label
        if label not in best or p.created >= best[label].created:
            best[label] = p
    return best


def cheapest_storage(
    profiles: Iterable[Profile],
    costs: Mapping[str, float],
    ratio: float,
    L: float,
    cost_model: CostModel | None = None,
    archive_bytes: float | None = None,
) -> StorageDecision:
    """Among profiled locations priced in ``costs`` ($/GB-month), the cheapest whose loading hides recompute.

    A location qualifies when ``T_load(L) <= T_recompute(ratio, L)``. Recompute
    cost comes from ``cost_model`` when given (the compute device in use), else
    from each profile. With ``archive_bytes``, each option carries its monthly
    cost. ``choice`` is None when no priced location hides recompute.
    """
    latest = latest_by_label(profiles)
    options = []
    for label, price in costs.items():
        p = latest.get(label)
        if p is None:
            continue
        t_load = p.load_model().time(L)
        t_rec = recompute_time(ratio, L, cost_model or p.cost_model)
        monthly = archive_bytes / 1e9 * price if archive_bytes is not None else None
        options.append(StorageOption(label, float(price), t_load, t_rec, t_load <= t_rec, monthly, p.name))
    options.sort(key=lambda o: (o.price_per_GB_month, o.t_load_s))
    hiding = [o for o in options if o.hides]
    return StorageDecision(hiding[0] if hiding else None, options, [label for label in costs if label not in latest])


def parse_costs(text: str) -> dict[str, float]:
    """'ram=5,nvme=0.1,hdd=0.02' → {'ram': 5.0, ...} ($ per GB-month)."""
    costs: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        label, sep, value = part.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        if not sep or not label.strip() or price < 0 or not math.isfinite(price):
            raise UsageError(f"--storage-costs takes label=$/GB-month pairs like ram=5,nvme=0.1, not {part!r}")
        costs[label.strip()] = price
    return costs
