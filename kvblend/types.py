"""Types every layer of kvblend exchanges, free of torch at import time.

`Segment` is the unit a prompt is made of; it lives here, not in the fusor,
because prompt assembly, the feeds, the pipeline and the fusor all speak it.
"""

from __future__ import annotations

import time
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


class Waiting:
    """What stepwise work yields while it can do nothing but wait for someone else (another writer storing a
    segment it needs). A server gives the turn to other requests instead of spending it on this one; a plain
    call sleeps a moment before asking again."""

    def __repr__(self) -> str:
        return "WAITING"


WAITING = Waiting()
WAIT_POLL_S = 0.01  # how long a drained caller sleeps when the work it runs yields WAITING

#: Work done in steps: a generator that yields at safe points between units of work (None, or WAITING when it
#: is blocked on another writer) and returns its result. A server interleaves many (one request's fusion between
#: other requests' decode steps); a plain call drains it with :func:`drain`.
Steps = Generator[Waiting | None, None, T]


def drain(steps: Steps[T]) -> T:
    """Run stepwise work to its end and return its result."""
    while True:
        try:
            if next(steps) is WAITING:
                time.sleep(WAIT_POLL_S)
        except StopIteration as done:
            return done.value
