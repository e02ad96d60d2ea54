"""kvblend: CacheBlend for RAG — reuse every retrieved chunk's KV from an on-disk archive.

Python API (the CLI is a thin layer over the same calls)::

    import kvblend

    runner = kvblend.load_model()                       # bundled SmolLM2-135M-Instruct
    ids = [runner.tokenize(t) for t in chunks]
    kv = kvblend.precompute_kv(runner, ids)            # each chunk prefilled alone
    segments = [kvblend.Segment(i, kv=k) for i, k in zip(ids, kv)]
    prompt = kvblend.assemble_prompt(runner, kvblend.PromptTemplate(), "Who…?", segments)
    fused = kvblend.fuse(runner, prompt, "blend", kvblend.BlendConfig.single(0.15))
    print(kvblend.generate(runner, fused).text)

    with kvblend.Engine(archive="~/kv") as engine:      # archive-backed
        engine.ingest(["docs/"])
        print(engine.query("Who…?").answer)

Every name is imported on first use: `import kvblend` (and so the CLI's
`--help`, `ls`, `verify`, ...) never pays for torch unless a model is needed.
"""

from __future__ import annotations

from importlib import import_module

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "KvblendError": "kvblend.errors",
    "Segment": "kvblend.types",
    "MODES": "kvblend.options",
    "BlendConfig": "kvblend.fusion",
    "FusionResult": "kvblend.fusion",
    "fuse": "kvblend.fusion",
    "Generation": "kvblend.generation",
    "SamplingConfig": "kvblend.options",
    "generate": "kvblend.generation",
    "ModelRunner": "kvblend.model",
    "load_model": "kvblend.model",
    "precompute_kv": "kvblend.model.prefill",
    "MUSIQUE_TEMPLATE": "kvblend.options",
    "PromptTemplate": "kvblend.options",
    "assemble_prompt": "kvblend.prompt",
    "Engine": "kvblend.pipeline",
    "QueryOptions": "kvblend.options",
    "QueryResult": "kvblend.pipeline",
    "IngestReport": "kvblend.pipeline",
}


def __getattr__(name: str):
    """Import a public name's module on first access (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvblend' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = sorted(_EXPORTS)
