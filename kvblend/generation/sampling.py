"""The sampler: the next token from a sequence's logits, and log-probabilities as OpenAI reports them."""

from __future__ import annotations

import torch

from kvblend.options import SamplingConfig


def next_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> int:
    """Greedy argmax, or temperature + nucleus sampling."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < sampling.top_p
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


def logprobs_of(logits: torch.Tensor, token: int, top: int = 0) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log-probability under the model's distribution, and the `top` most likely tokens with
    theirs (OpenAI's `logprobs` / `top_logprobs`), from the same logits the sampler used."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    alternatives: list[tuple[int, float]] = []
    if top:
        values, ids = torch.topk(logp, top)
        alternatives = [(int(i), float(v)) for i, v in zip(ids, values)]
    return float(logp[token]), alternatives
