"""What an OpenAI request asks of kvblend: QueryOptions for its prompt, OutputParams for each of its choices."""

from __future__ import annotations

from kvblend.defaults import DEFAULT_MODE, DEFAULT_TOP_K
from kvblend.generation import OutputParams
from kvblend.options import PromptTemplate, QueryOptions, SamplingConfig
from kvblend.serve.schema import ChatRequest


def query_options(req: ChatRequest, max_stored_tokens: int | None = None) -> QueryOptions:
    """The pipeline options for a request: client chunks replace retrieval unless top_k asks for both."""
    top_k = req.top_k if req.top_k is not None else (0 if req.chunks else DEFAULT_TOP_K)
    return QueryOptions(
        mode=req.mode or DEFAULT_MODE,
        ratio=req.ratio,
        top_k=top_k,
        docs=tuple(req.docs),
        context_texts=tuple(req.chunks),
        store_context=req.store,
        restore_missing=req.store,
        max_stored_tokens=max_stored_tokens,
        template=PromptTemplate(system=req.system) if req.system else PromptTemplate(),
        sampling=SamplingConfig(req.max_tokens, req.temperature, req.top_p, req.seed),
    )


def output_params(req: ChatRequest, choice: int) -> OutputParams:
    """How choice `choice` of `req` is sampled and stopped. With a seed, each of n choices samples from its own
    seed (seed + index): independent of each other, and repeatable."""
    seed = None if req.seed is None else (req.seed + choice) % 2**63
    return OutputParams(
        SamplingConfig(req.max_tokens, req.temperature, req.top_p, seed),
        stop=tuple(req.stop),
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs,
    )
