"""The model layer: a causal LM run one decoder layer at a time, with no transformers at run time.

    source.py     where the weights are and what identifies them (no torch)
    config.py     config.json → ModelConfig (no torch)
    transformer.py  the decoder's modules, loaded from safetensors under the checkpoint's names
    tokenizer.py  tokenizer.json + the chat template
    loading.py    device/dtype choice, GGUF conversion (the only use of transformers), load_model
    runner.py     ModelRunner: embed → (project_qkv → attend → finish_layer)* → logits
    attention.py  the attention kernels the runner chooses between
    rope.py       RoPE, and re-rotating archived K to a new position
    prefill.py    batched prefill of segments alone, for the archive

`ModelRunner` and `load_model` are resolved on first use, so importing
`kvblend.model.source` does not import torch.
"""

from __future__ import annotations

__all__ = ["ModelRunner", "load_model"]


def __getattr__(name: str):
    if name == "ModelRunner":
        from kvblend.model.runner import ModelRunner

        return ModelRunner
    if name == "load_model":
        from kvblend.model.loading import load_model

        return load_model
    raise AttributeError(f"module 'kvblend.model' has no attribute {name!r}")
