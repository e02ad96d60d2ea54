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
"""

from kvblend.errors import KvblendError
from kvblend.fusor import MODES, BlendConfig, FusionResult, Segment, fuse
from kvblend.generate import Generation, SamplingConfig, generate
from kvblend.model import ModelRunner, load_model
from kvblend.precompute import precompute_kv
from kvblend.prompt import MUSIQUE_TEMPLATE, PromptTemplate, assemble_prompt

__version__ = "0.1.0"


def __getattr__(name: str):
    """Engine pulls in the archive stack; import it on first use only."""
    if name in ("Engine", "QueryOptions", "QueryResult", "IngestReport"):
        from kvblend import engine

        return getattr(engine, name)
    raise AttributeError(name)


__all__ = [
    "KvblendError", "MODES", "BlendConfig", "FusionResult", "Segment", "fuse", "Generation",
    "SamplingConfig", "generate", "ModelRunner", "load_model", "precompute_kv", "MUSIQUE_TEMPLATE",
    "PromptTemplate", "assemble_prompt", "Engine", "QueryOptions", "QueryResult", "IngestReport",
]
