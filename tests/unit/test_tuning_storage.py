"""Storage pricing: the cheapest profiled location whose loading still hides recompute; option parsing."""

from __future__ import annotations

import pytest

from kvblend.errors import UsageError
from kvblend.defaults import DEFAULT_RATIO
from kvblend.evaluation.records import parse_ratios
from kvblend.tuning.delay import CostModel
from kvblend.tuning.storage import cheapest_storage, parse_costs
from tuning_helpers import CTX, synthetic_profile

COSTS = {"ram": 5.0, "nvme": 0.1, "ssd": 0.05, "hdd": 0.02}


def test_storage_70b_prefers_cheaper_slower_device_only_while_it_hides():
    # recompute at 15% = 7 ms per layer; ram 0.5 ms, nvme 4 ms, ssd 6 ms hide it, hdd 16 ms does not
    profiles = [
        synthetic_profile("ram", 0.0005, 0.007),
        synthetic_profile("nvme", 0.004, 0.007),
        synthetic_profile("ssd", 0.006, 0.007),
        synthetic_profile("hdd", 0.016, 0.007),
    ]
    d = cheapest_storage(profiles, COSTS, 0.15, CTX, archive_bytes=100e9)
    assert d.choice.label == "ssd"  # cheaper than nvme and still hides; hdd is cheaper but adds delay
    assert d.choice.monthly_cost == pytest.approx(5.0)  # 100 GB × $0.05
    by = {o.label: o for o in d.candidates}
    assert by["hdd"].hides is False and by["nvme"].hides and by["ram"].hides
    assert by["hdd"].t_load_s == pytest.approx(0.016) and by["hdd"].t_recompute_s == pytest.approx(0.007)
    # without the ssd, nvme; with only hdd priced, nothing qualifies
    assert cheapest_storage(profiles, {"ram": 5, "nvme": 0.1, "hdd": 0.02}, 0.15, CTX).choice.label == "nvme"
    assert cheapest_storage(profiles, {"hdd": 0.02}, 0.15, CTX).choice is None


def test_storage_7b_needs_ram_at_15_percent_but_nvme_hides_at_80():
    profiles = [
        synthetic_profile("ram", 0.0005, 0.003),
        synthetic_profile("nvme", 0.016, 0.003),
        synthetic_profile("hdd", 0.064, 0.003),
    ]
    assert cheapest_storage(profiles, COSTS, 0.15, CTX).choice.label == "ram"
    assert cheapest_storage(profiles, COSTS, 0.8, CTX).choice.label == "nvme"
    d = cheapest_storage(profiles, COSTS, 0.8, CTX)
    assert d.unprofiled == ["ssd"]


def test_storage_uses_latest_profile_per_label_and_given_cost_model():
    old = synthetic_profile("hdd", 0.001, 0.007, created=1.0)
    new = synthetic_profile("hdd", 0.050, 0.007, created=2.0)
    assert cheapest_storage([new, old], {"hdd": 0.02}, 0.15, CTX).choice is None
    # the recompute side from the compute device in use, not the stored one
    fast_compute = CostModel.from_point(0.15, CTX, 0.100)
    assert cheapest_storage([new], {"hdd": 0.02}, 0.15, CTX, cost_model=fast_compute).choice.label == "hdd"


def test_parse_costs_and_ratios():
    assert parse_costs("ram=5, nvme=0.1,hdd=0.02") == {"ram": 5.0, "nvme": 0.1, "hdd": 0.02}
    for bad in ("ram", "ram=x", "=3", "ram=-1"):
        with pytest.raises(UsageError):
            parse_costs(bad)
    assert parse_ratios("0.3,0.05,0.15") == (0.3, 0.05, 0.15)  # as given; tune sorts them
    assert parse_ratios("default, 0.3") == (DEFAULT_RATIO, 0.3)  # bench --ratios default: whatever queries use
    for bad in ("0", "1.5", "a,b", "", "defaults"):
        with pytest.raises(UsageError):
            parse_ratios(bad)
