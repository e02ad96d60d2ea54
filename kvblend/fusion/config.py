"""BlendConfig: where blend checks KV deviation, and how many cached tokens each check keeps."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from kvblend.defaults import DEFAULT_CHECK_LAYERS, DEFAULT_DEVIATION, DEFAULT_RATIO, DEVIATIONS
from kvblend.errors import UsageError


@dataclass(frozen=True)
class BlendConfig:
    """Check layers and their ratios (fractions of *cached* tokens kept active)."""

    check_layers: tuple[int, ...] = DEFAULT_CHECK_LAYERS
    ratios: tuple[float, ...] = (DEFAULT_RATIO,)
    deviation: str = DEFAULT_DEVIATION

    @classmethod
    def single(
        cls, ratio: float = DEFAULT_RATIO, check_layer: int = DEFAULT_CHECK_LAYERS[0], deviation: str = DEFAULT_DEVIATION
    ) -> "BlendConfig":
        return cls((check_layer,), (ratio,), deviation)

    @classmethod
    def gradual(cls, ratio: float, check_layers: Sequence[int], deviation: str = DEFAULT_DEVIATION) -> "BlendConfig":
        """The paper's gradual filtering: ratios shrink toward `ratio` at the last check layer.

        r_j = ratio · (1 + 0.5·(n−1−j)/n), e.g. 3 layers at 0.15 → 0.20, 0.175, 0.15.
        """
        n = len(check_layers)
        ratios = tuple(min(1.0, ratio * (1 + 0.5 * (n - 1 - j) / n)) for j in range(n))
        return cls(tuple(check_layers), ratios, deviation)

    def validate(self, n_layers: int) -> None:
        """Refuse settings the fusor cannot honour, with the flag's vocabulary in the message."""
        if not self.check_layers:
            raise UsageError("blend needs at least one check layer")
        if len(self.check_layers) != len(self.ratios):
            raise UsageError("give one ratio per check layer")
        for r in self.ratios:
            if not (0.0 < r <= 1.0) or math.isnan(r):
                raise UsageError(f"recompute ratio must be in (0, 1], got {r}")
        if list(self.check_layers) != sorted(set(self.check_layers)):
            raise UsageError("check layers must be distinct and ascending")
        for layer in self.check_layers:
            if not 0 <= layer < n_layers:
                raise UsageError(f"check layer {layer} is beyond the model's depth (layers 0..{n_layers - 1})")
        if list(self.ratios) != sorted(self.ratios, reverse=True):
            raise UsageError("gradual filtering needs non-increasing ratios across check layers")
        if self.deviation not in DEVIATIONS:
            raise UsageError(f"deviation must be one of {', '.join(DEVIATIONS)}")
