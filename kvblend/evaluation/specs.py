"""What one benchmark run is (:class:`RunSpec`) and what it produced (:class:`RunRecord`).

A spec is a hashable value, so identical configurations asked for under
different names (blend@0.15 in the main table and "deviation v" among the
variants) run once and are reported under each name. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvblend.archive.codec import check_codec
from kvblend.defaults import (
    DEFAULT_CODEC,
    DEFAULT_DEVIATION,
    DEFAULT_SELECT,
    default_check_layers,
)
from kvblend.errors import UsageError
from kvblend.evaluation.records import DEFAULT_VARIANT_RATIO
from kvblend.options import DEVIATIONS, SELECTIONS, Deviation, Mode, Select, choice

#: How the cached chunks were prefilled: alone (what the archive stores by default), after the chat
#: template's first tokens (`ingest --sink template`), or after the prompt's whole instruction prefix;
#: the sink's KV dropped. Compared in memory.
SINK_POLICIES = ("alone", "template", "shared-prefix")
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
    check_layers: tuple[int, ...] = ()  # none given: the selection policy's default (defaults.default_check_layers)
    sink: str = "alone"
    source: str = "archive"
    codec: str = DEFAULT_CODEC  # how the passages' KV is archived (canonical name; aliases resolved)
    select: str = DEFAULT_SELECT  # blend's selection policy

    def __post_init__(self) -> None:
        # full reads no passage KV and prefix only the (lossless) instruction prefix: one run serves every codec
        lossy_irrelevant = self.mode in ("full", "prefix") or self.source == "memory"
        object.__setattr__(self, "codec", DEFAULT_CODEC if lossy_irrelevant else check_codec(self.codec))
        choice(Mode, self.mode, "mode")
        if self.mode != "blend":  # the blend knobs do not apply: normalise so equal runs compare equal
            object.__setattr__(self, "ratio", None)
            object.__setattr__(self, "deviation", DEFAULT_DEVIATION)
            object.__setattr__(self, "select", DEFAULT_SELECT)
            object.__setattr__(self, "check_layers", default_check_layers(DEFAULT_SELECT))
        elif self.ratio is None:
            raise UsageError("a blend run needs a ratio")
        elif not self.check_layers:
            object.__setattr__(self, "check_layers", default_check_layers(self.select))
        choice(Deviation, self.deviation, "deviation")
        choice(Select, self.select, "selection policy")
        if self.sink not in SINK_POLICIES:
            raise UsageError(f"sink policy must be one of {', '.join(SINK_POLICIES)}")
        if self.source not in SOURCES:
            raise UsageError("source must be archive or memory")
        if self.sink != "alone" and self.source != "memory":
            raise UsageError("a sink policy other than the archive's (bench's --sink) runs in memory")

    @property
    def label(self) -> str:
        text = self.mode if self.ratio is None else f"{self.mode}@{self.ratio:g}"
        if self.mode == "blend" and (
            self.deviation != DEFAULT_DEVIATION or self.check_layers != default_check_layers(self.select)
        ):
            text += f" dev={self.deviation} L={','.join(map(str, self.check_layers))}"
        if self.mode == "blend" and self.select != DEFAULT_SELECT:
            text += f" select={self.select}"
        if self.source == "memory":
            text += f" [{self.sink}, in memory]"
        if self.codec != DEFAULT_CODEC:
            text += f" [{self.codec}]"
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
    stored_bytes: int = 0  # the record's passages as archived with the spec's codec (0: none read)
    stored_tokens: int = 0
    stream: Any = None  # the archive feed's StreamStats (bytes read, read / build seconds), if it streamed
    # drift along full's answer, teacher-forced (issue 33): KL(full ‖ run) per position, and the first position
    # where the run's greedy token is not full's (None: it agrees through every forced token)
    position_kls: list[float] = field(default_factory=list)
    diverges_at: int | None = None
    stale: Any = None  # kvblend.evaluation.drift.StaleReading at the diverging step (None: no divergence)


def main_specs(
    modes: Sequence[str],
    ratios: Sequence[float],
    codecs: Sequence[str] = (DEFAULT_CODEC,),
    select: str = DEFAULT_SELECT,
) -> list[RunSpec]:
    """The runs of the main table: each mode, blend once per ratio, per codec; full always (it is the
    reference) and once (as prefix: neither reads the passages' KV)."""
    specs = [FULL]
    for codec in codecs:
        for m in modes:
            if m == "blend":
                specs.extend(RunSpec("blend", r, codec=codec, select=select) for r in ratios)
            elif m != "full":
                specs.append(RunSpec(m, codec=codec))
    return list(dict.fromkeys(specs))


def variant_specs(ratio: float = DEFAULT_VARIANT_RATIO) -> list[tuple[str, str, RunSpec]]:
    """(group, name, spec) for the fusor-choice comparison, all at `ratio`."""
    rows: list[tuple[str, str, RunSpec]] = []
    for policy in SELECTIONS:
        rows.append(("select", policy, RunSpec("blend", ratio, select=policy)))
    for dev in DEVIATIONS:  # the measure of the HKVD baseline
        rows.append(("deviation", f"hkvd {dev}", RunSpec("blend", ratio, deviation=dev, select="hkvd")))
    for layers in ((0,), (1,), (2,), (1, 2, 3)):  # 0: the probe chooses before layer 0 (the default policy only)
        name = ",".join(map(str, layers)) + (" (gradual)" if len(layers) > 1 else "")
        rows.append(("check_layers", name, RunSpec("blend", ratio, check_layers=layers)))
    for sink in SINK_POLICIES:
        rows.append(("sink", f"{sink} reuse", RunSpec("reuse", sink=sink, source="memory")))
        rows.append(("sink", f"{sink} blend@{ratio:g}", RunSpec("blend", ratio, sink=sink, source="memory")))
    return rows
