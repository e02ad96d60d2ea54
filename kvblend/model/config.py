"""A checkpoint's `config.json`, read into the few numbers the forward pass needs. No torch.

kvblend runs its own forward pass (kvblend.model.transformer), so it reads the
Hugging Face config itself rather than through transformers: importing
transformers costs ~5 s per command on a 2-core VM, more than loading the
weights. Both spellings transformers has written are read: v5's
`rope_parameters` (one dict, or one per layer type) and v4's `rope_theta` +
`rope_scaling` (+ Gemma 3's `rope_local_base_freq`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvblend.errors import ModelNotFoundError, UnsupportedModelError
from kvblend.model.source import SUPPORTED_ARCHITECTURES, check_architecture

# `model_type` → architecture, for configs that do not list `architectures`.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

# RoPE whose frequencies are fixed by the config; the runner computes each of these (kvblend.model.transformer).
ROPE_TYPES = ("default", "linear", "llama3")

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE kind: its base, its type and that type's parameters."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """What the forward pass needs from config.json, under the names transformers gives them."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str
    layer_types: tuple[str, ...]  # FULL or SLIDING per layer
    sliding_window: int | None  # the window of SLIDING layers (every layer's, for Mistral)
    rope: dict[str, RopeSpec]  # per layer type
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale is this ** -0.5
    final_logit_softcapping: float | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def is_gemma(self) -> bool:
        return self.architecture == "Gemma3ForCausalLM"

    def window(self, layer: int) -> int | None:
        """The layer's sliding window, None for global attention."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        """Read a config dict (config.json, or transformers' `config.to_dict()`), refusing what we cannot run."""
        archs = list(cfg.get("architectures") or [])
        if not archs and not cfg.get("model_type"):
            raise UnsupportedModelError("config.json names no architecture (neither `architectures` nor `model_type`)")
        arch = archs[0] if archs else _MODEL_TYPES.get(str(cfg["model_type"]), str(cfg["model_type"]))
        check_architecture(None, arch)
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            n_layers = int(cfg["num_hidden_layers"])
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            gemma = arch == "Gemma3ForCausalLM"
            layer_types = _layer_types(cfg, arch, n_layers)
            window = cfg.get("sliding_window")
            if arch == "Qwen2ForCausalLM" or arch == "Qwen3ForCausalLM":
                window = window if cfg.get("use_sliding_window") and SLIDING in layer_types else None
            eos = (generation or {}).get("eos_token_id", cfg.get("eos_token_id"))
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=n_layers,
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
                hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"),
                layer_types=layer_types,
                sliding_window=int(window) if window else None,
                rope=_rope(cfg, arch, layer_types),
                query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]) if gemma else None,
                final_logit_softcapping=cfg.get("final_logit_softcapping"),
                eos_token_ids=tuple(int(i) for i in ([eos] if isinstance(eos, int) else (eos or []))),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelNotFoundError(
                f"config.json of {arch} is incomplete or malformed ({type(e).__name__}: {e})"
            ) from None

    @classmethod
    def read(cls, directory: Path) -> ModelConfig:
        """config.json (+ generation_config.json, which names the end-of-turn ids) of a checkpoint directory."""
        generation = directory / "generation_config.json"
        return cls.from_dict(
            read_json_object(directory / "config.json"), read_json_object(generation) if generation.is_file() else None
        )


def read_json_object(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file as a dict; anything else (unreadable, not JSON, not an object) is one line."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelNotFoundError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ModelNotFoundError(f"cannot read {path}: not a JSON object")
    return data


def _layer_types(cfg: dict[str, Any], arch: str, n_layers: int) -> tuple[str, ...]:
    """FULL/SLIDING per layer: `layer_types` where given; Gemma 3 v4 configs give a pattern instead."""
    given = cfg.get("layer_types")
    if given:
        if len(given) != n_layers or any(t not in (FULL, SLIDING) for t in given):
            raise UnsupportedModelError(f"{arch}: layer_types {given!r} are not {FULL}/{SLIDING} per layer")
        return tuple(given)
    if arch == "Gemma3ForCausalLM":
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n_layers))
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM") and cfg.get("sliding_window"):
        return (SLIDING,) * n_layers  # every layer in the one window (Phi-3 mini: 2,047 tokens)
    return (FULL,) * n_layers


def _rope(cfg: dict[str, Any], arch: str, layer_types: tuple[str, ...]) -> dict[str, RopeSpec]:
    """One RopeSpec per layer type in use."""
    params = cfg.get("rope_parameters")
    if params is None:  # transformers v4: rope_theta + rope_scaling (+ Gemma 3's local base)
        global_params = {"rope_theta": cfg.get("rope_theta", 10000.0), **(cfg.get("rope_scaling") or {})}
        local_theta = cfg.get("rope_local_base_freq")
        params = {FULL: global_params, SLIDING: {"rope_theta": local_theta}} if local_theta else global_params
    per_type = params if FULL in params or SLIDING in params else {t: params for t in (FULL, SLIDING)}
    return {t: _rope_spec(arch, per_type.get(t) or per_type.get(FULL) or {}) for t in set(layer_types)}


def _rope_spec(arch: str, p: dict[str, Any]) -> RopeSpec:
    kind = str(p.get("rope_type") or p.get("type") or "default")
    partial = float(p.get("partial_rotary_factor") or 1.0)
    if partial != 1.0:  # Phi-4-mini rotates 3/4 of each head: kvblend's RoPE and re-rotation turn whole heads
        raise UnsupportedModelError(f"{arch} with RoPE on part of each head ({partial:g}) is not supported")
    if kind not in ROPE_TYPES:
        why = (
            ": its frequencies change with the sequence length, so KV prefilled alone cannot be re-positioned exactly"
            if "dynamic" in kind or kind == "longrope"
            else ""
        )
        raise UnsupportedModelError(
            f"{arch} with {kind} RoPE is not supported (kvblend runs {', '.join(ROPE_TYPES)} RoPE){why}"
        )
    return RopeSpec(
        theta=float(p.get("rope_theta") or 10000.0),
        rope_type=kind,
        factor=float(p.get("factor") or 1.0),
        low_freq_factor=float(p.get("low_freq_factor") or 1.0),
        high_freq_factor=float(p.get("high_freq_factor") or 4.0),
        original_max_position_embeddings=int(p.get("original_max_position_embeddings") or 8192),
    )


__all__ = ["FULL", "ROPE_TYPES", "SLIDING", "SUPPORTED_ARCHITECTURES", "ModelConfig", "RopeSpec"]
