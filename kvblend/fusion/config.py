"""BlendConfig: where blend selects tokens, how many cached tokens each check keeps, and by what policy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvblend.defaults import (
    DEFAULT_DEVIATION,
    DEFAULT_RATIO,
    DEFAULT_SELECT,
    default_check_layers,
)
from kvblend.errors import UsageError
from kvblend.options import Deviation, Select, check_ratio, choice


@dataclass(frozen=True)
class BlendConfig:
    """Check layers, their ratios (fractions of *approximate cached* tokens kept active), and the
    selection policy (kvblend.fusion.policies) with its deviation measure. No check layers given: the
    policy's default (kvblend.defaults.default_check_layers: before layer 0 for the probe, else layer 1)."""

    check_layers: tuple[int, ...] = ()
    ratios: tuple[float, ...] = (DEFAULT_RATIO,)
    deviation: str = DEFAULT_DEVIATION
    select: str = DEFAULT_SELECT

    def __post_init__(self) -> None:
        if not self.check_layers:
            object.__setattr__(self, "check_layers", default_check_layers(self.select))

    @classmethod
    def single(
        cls,
        ratio: float = DEFAULT_RATIO,
        check_layer: int | None = None,
        deviation: str = DEFAULT_DEVIATION,
        select: str = DEFAULT_SELECT,
    ) -> BlendConfig:
        """One check layer (None: the policy's default) keeping `ratio` of the approximate cached tokens."""
        return cls((check_layer,) if check_layer is not None else (), (ratio,), deviation, select)

    @property
    def selects(self) -> bool:
        """Does any check keep fewer than every cached token? (All ratios 1.0 is exactly `full`.)"""
        return self.ratios[-1] < 1.0

    @property
    def probes(self) -> bool:
        """Does this configuration run the probe pass (kvblend.fusion.probe) before the layer loop?"""
        return self.select == "probe" and self.selects

    @classmethod
    def gradual(
        cls, ratio: float, check_layers: Sequence[int], deviation: str = DEFAULT_DEVIATION, select: str = DEFAULT_SELECT
    ) -> BlendConfig:
        """The paper's gradual filtering: ratios shrink toward `ratio` at the last check layer.

        r_j = ratio · (1 + 0.5·(n−1−j)/n), e.g. 3 layers at 0.15 → 0.20, 0.175, 0.15.
        """
        check_layers = tuple(check_layers) or default_check_layers(select)
        n = len(check_layers)
        ratios = tuple(min(1.0, ratio * (1 + 0.5 * (n - 1 - j) / n)) for j in range(n))
        return cls(check_layers, ratios, deviation, select)

    def validate(self, n_layers: int) -> None:
        """Refuse settings the fusor cannot honour, with the flag's vocabulary in the message."""
        select = choice(Select, self.select, "selection policy")
        choice(Deviation, self.deviation, "deviation")
        if not self.check_layers:
            raise UsageError("blend needs at least one check layer")
        if len(self.check_layers) != len(self.ratios):
            raise UsageError("give one ratio per check layer")
        for r in self.ratios:
            check_ratio(r, "recompute ratio")
        if list(self.check_layers) != sorted(set(self.check_layers)):
            raise UsageError("check layers must be distinct and ascending")
        for layer in self.check_layers:
            if layer == 0 and not Select(select).scores_before_layer_0:
                raise UsageError(
                    "check layer 0 cannot tell which tokens matter: a token's layer-0 KV does not depend on the "
                    f"other tokens (prefilled alone or not, it is the same), so --select {self.select} has nothing "
                    "to score there; use 1 or deeper (only the probe, which scores in its own pass, may select "
                    "before layer 0)"
                )
            if not 0 <= layer < n_layers:
                raise UsageError(f"check layer {layer} is beyond the model's depth (layers 0..{n_layers - 1})")
        if list(self.ratios) != sorted(self.ratios, reverse=True):
            raise UsageError("gradual filtering needs non-increasing ratios across check layers")
