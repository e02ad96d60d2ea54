"""Which codec the archive should use: a smaller (lossy) one only where storage delays the first token.

Per layer, loading the cached KV runs beside recomputing the selected tokens,
and the slower of the two sets the pace (kvblend.tuning.delay)::

    pace(codec) = max(T_load(codec, L), T_recompute(r_quality, L))
    T_load(codec, L) = B_c·L / read + B_c·L / decode_c      (B_c: the codec's bytes per token-layer)

A lossy codec reads fewer bytes but spends decode time, and it costs fidelity
(BENCHMARKS.md, codecs), so `tune` names one only where the archive's own
codec is more than :data:`MARGIN` slower than the fastest, and then the most
faithful codec within that margin of the fastest.
Recompute is priced at the quality floor, not at the chosen ratio: the
chosen ratio already stretches recompute to cover loading (r ≥ r_hide), so
loading never looks like the bottleneck at it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from kvblend.tuning.delay import CostModel, recompute_time
from kvblend.tuning.profile import Profile

#: A lossy codec must shorten the per-layer pace by more than this share to be worth its fidelity cost.
MARGIN = 0.05
#: Most faithful first: lossless codecs, then more bits before fewer.
FIDELITY_ORDER = ("zstd-shuffle", "zstd", "int8", "int4")


@dataclass
class CodecOption:
    codec: str
    bytes_per_token_layer: float
    t_load_s: float  # one layer at L: read + decode
    pace_s: float  # max(t_load_s, recompute at the quality floor)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CodecOption:
        return cls(**{k: d[k] for k in ("codec", "bytes_per_token_layer", "t_load_s", "pace_s")})


@dataclass
class CodecDecision:
    """The archive's codec, the one `tune` recommends (the same when no other is worth it), and why."""

    current: str | None
    choice: str | None
    options: list[CodecOption] = field(default_factory=list)
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CodecDecision:
        return cls(
            d.get("current"), d.get("choice"), [CodecOption.from_dict(o) for o in d.get("options") or []], d.get("note")
        )


def _faithfulness(codec: str) -> int:
    return FIDELITY_ORDER.index(codec) if codec in FIDELITY_ORDER else len(FIDELITY_ORDER)


def choose_codec(profile: Profile, r_quality: float, L: float, cost_model: CostModel) -> CodecDecision:
    """Price every profiled codec at context length L; recommend a smaller one only where loading sets the pace."""
    if not profile.codecs:
        return CodecDecision(profile.codec, profile.codec, [], None)
    t_rec = recompute_time(r_quality, L, cost_model)
    options = []
    for codec in dict.fromkeys([str(profile.codec), *profile.codecs]):
        load = profile.load_model(codec=codec)
        t_load = load.time(L)
        options.append(CodecOption(codec, load.bytes_per_token_layer, t_load, max(t_load, t_rec)))
    current = options[0]
    fastest = min(o.pace_s for o in options)
    if current.pace_s <= fastest * (1 + MARGIN):
        return CodecDecision(current.codec, current.codec, options, None)
    near_fastest = [o for o in options if o.pace_s <= fastest * (1 + MARGIN)]
    choice = min(near_fastest, key=lambda o: (_faithfulness(o.codec), o.pace_s))
    note = (
        f"storage sets the pace: loading {current.codec} takes {current.t_load_s * 1e3:.2f} ms a layer at "
        f"L = {int(L)} against {t_rec * 1e3:.2f} ms of recompute at the quality floor; re-ingest with "
        f"`--codec {choice.codec}` ({choice.bytes_per_token_layer:.0f} B per token-layer, loads in "
        f"{choice.t_load_s * 1e3:.2f} ms) and re-run `kvblend tune`"
    )
    return CodecDecision(current.codec, choice.codec, options, note)
