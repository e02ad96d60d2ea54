"""Types every layer of kvblend exchanges, free of torch at import time.

`Segment` is the unit a prompt is made of; it lives here, not in the fusor,
because prompt assembly, the feeds, the pipeline and the fusor all speak it.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # annotations only: importing this module must not import torch
    import torch

T = TypeVar("T")

# Layer KV as the fusor and archive exchange it: K post-RoPE, [batch, kv_heads, seq, head_dim]
# (or [kv_heads, seq, head_dim] for a single stored segment).
LayerKV = tuple["torch.Tensor", "torch.Tensor"]


@dataclass
class Segment:
    """One piece of the prompt. `kv` (per layer, [kv_heads, n, hd]) makes it cached for in-memory use.

    `base_position` is the position the segment's first token had when its KV was
    prefilled (0 when prefilled alone; >0 when prefilled after a shared sink prefix).
    """

    token_ids: list[int]
    kv: list[LayerKV] | None = None
    cached: bool | None = None
    base_position: int = 0
    key: str | None = None

    def __post_init__(self) -> None:
        if self.cached is None:
            self.cached = self.kv is not None


#: Work done in steps: a generator that yields at safe points between units of work and returns its result.
#: A server interleaves many (one request's fusion between other requests' decode steps); a plain call
#: drains it with :func:`drain`.
Steps = Generator[None, None, T]


def drain(steps: Steps[T]) -> T:
    """Run stepwise work to its end and return its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
