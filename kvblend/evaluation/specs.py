"""What one benchmark run is (:class:`RunSpec`) and what it produced (:class:`RunRecord`).

A spec is a hashable value, so identical configurations asked for under
different names (blend@0.15 in the main table and "deviation v" among the
variants) run once and are reported under each name. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvblend.defaults import DEFAULT_CHECK_LAYERS, DEFAULT_DEVIATION, DEVIATIONS, MODES
from kvblend.errors import UsageError
from kvblend.evaluation.records import DEFAULT_VARIANT_RATIO

#: How the cached chunks were prefilled: alone (what the archive stores), or after the
#: prompt's shared instruction prefix (its KV dropped; compared in memory only).
SINK_POLICIES = ("alone", "shared-prefix")
SOURCES = ("archive", "memory")


@dataclass(frozen=True)
class RunSpec:
    """One way of answering: a mode, and for blend its ratio, deviation and check layers.

    `sink` says how the cached chunks were prefilled; `source` whether their KV
    streams from the archive (the engine's path) or is held in memory.
    """

    mode: str
    ratio: float | None = None
    deviation: str = DEFAULT_DEVIATION
    check_layers: tuple[int, ...] = DEFAULT_CHECK_LAYERS
    sink: str = "alone"
    source: str = "archive"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UsageError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.mode != "blend":  # the blend knobs do not apply: normalise so equal runs compare equal
            object.__setattr__(self, "ratio", None)
            object.__setattr__(self, "deviation", DEFAULT_DEVIATION)
            object.__setattr__(self, "check_layers", DEFAULT_CHECK_LAYERS)
        elif self.ratio is None:
            raise UsageError("a blend run needs a ratio")
        if self.deviation not in DEVIATIONS:
            raise UsageError(f"deviation must be one of {', '.join(DEVIATIONS)}")
        if self.sink not in SINK_POLICIES:
            raise UsageError(f"sink policy must be one of {', '.join(SINK_POLICIES)}")
        if self.source not in SOURCES:
            raise UsageError("source must be archive or memory")
        if self.sink != "alone" and self.source != "memory":
            raise UsageError("the archive stores chunks prefilled alone; other sink policies run in memory")

    @property
    def label(self) -> str:
        text = self.mode if self.ratio is None else f"{self.mode}@{self.ratio:g}"
        if self.mode == "blend" and (self.deviation != DEFAULT_DEVIATION or self.check_layers != DEFAULT_CHECK_LAYERS):
            text += f" dev={self.deviation} L={','.join(map(str, self.check_layers))}"
        if self.source == "memory":
            text += f" [{self.sink}, in memory]"
        return text


FULL = RunSpec("full")


@dataclass
class RunRecord:
    """One run on one record: what it answered and what it cost, scored against full at run time."""

    record: int
    spec: RunSpec
    answer: str
    golds: list[str]
    ttft_s: float
    recompute_share: float
    kl_vs_full: float
    answer_kl_vs_full: float
    prompt_tokens: int = 0


def main_specs(modes: Sequence[str], ratios: Sequence[float]) -> list[RunSpec]:
    """The runs of the main table: each mode, blend once per ratio; full always (it is the reference)."""
    specs = [FULL]
    for m in modes:
        if m == "blend":
            specs.extend(RunSpec("blend", r) for r in ratios)
        elif m != "full":
            specs.append(RunSpec(m))
    return specs


def variant_specs(ratio: float = DEFAULT_VARIANT_RATIO) -> list[tuple[str, str, RunSpec]]:
    """(group, name, spec) for the fusor-choice comparison, all at `ratio`."""
    rows: list[tuple[str, str, RunSpec]] = []
    for dev in DEVIATIONS:
        rows.append(("deviation", dev, RunSpec("blend", ratio, deviation=dev)))
    for layers in ((1,), (2,), (1, 2, 3)):
        name = ",".join(map(str, layers)) + (" (gradual)" if len(layers) > 1 else "")
        rows.append(("check_layers", name, RunSpec("blend", ratio, check_layers=layers)))
    for sink in SINK_POLICIES:
        rows.append(("sink", f"{sink} reuse", RunSpec("reuse", sink=sink, source="memory")))
        rows.append(("sink", f"{sink} blend@{ratio:g}", RunSpec("blend", ratio, sink=sink, source="memory")))
    return rows
