"""Synthetic profiles for the tuning tests: chosen load and recompute times, no measurement."""

from __future__ import annotations

import time

from kvblend.tuning.delay import CostModel
from kvblend.machine import Machine
from kvblend.tuning.profile import LayerCost, ModelInfo, Profile, StorageInfo

CTX = 4096  # the paper's example context


def synthetic_profile(
    label: str,
    t_load_s: float,
    recompute_15_s: float,
    bytes_per_token_layer: float = 16384,
    L: int = CTX,
    path: str | None = None,
    machine: Machine | None = None,
    compute: str = "cpu",
    fingerprint: str = "fp",
    created: float | None = None,
) -> Profile:
    """A profile whose storage loads one layer of L tokens in t_load_s and recomputes 15% in recompute_15_s."""
    read_MBps = bytes_per_token_layer * L / t_load_s / 1e6
    model = CostModel.from_point(0.15, L, recompute_15_s)
    return Profile(
        name=f"test|{label}",
        created=created if created is not None else time.time(),
        machine=machine or Machine("h", "c", None, None),
        model=ModelInfo("m", fingerprint),
        compute=compute,
        storage=StorageInfo(label, path),
        read_cold_MBps=read_MBps,
        read_warm_MBps=read_MBps * 10,
        kv_bytes_per_token_layer=bytes_per_token_layer,
        layer_cost=LayerCost(model.a, model.b),
    )
