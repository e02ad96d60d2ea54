"""Fusion: build a prompt's KV from cached segments, recomputing only the tokens that matter.

config.py     BlendConfig (check layers, ratios, deviation measure)
plan.py       which tokens each mode takes from cache; which cached layers it reads
selection.py  HKVD: the cached tokens whose KV deviates most, kept for recompute
fuse.py       the layer loop shared by full / prefix / reuse / blend
"""

from kvblend.fusion.config import BlendConfig
from kvblend.fusion.fuse import CachedKVFeed, FusionResult, fuse, fuse_steps
from kvblend.fusion.plan import Plan, effective_cached, feed_schedule, plan_prompt
from kvblend.options import MODES

__all__ = [
    "MODES",
    "BlendConfig",
    "CachedKVFeed",
    "FusionResult",
    "Plan",
    "effective_cached",
    "feed_schedule",
    "fuse",
    "fuse_steps",
    "plan_prompt",
]
