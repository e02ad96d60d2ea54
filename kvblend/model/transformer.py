"""The decoder's weights as plain torch modules, loaded from safetensors; no transformers at run time.

Module and parameter names are the Hugging Face checkpoint's own
(`model.layers.3.self_attn.q_proj.weight`, ...), so a checkpoint's tensors load
by name with no mapping table, and a test can load any transformers model's
state dict into it to compare the two forward passes. The forward pass itself
is ModelRunner's (embed → per layer project_qkv, attend, finish_layer → logits):
these modules are only what it calls.

Why not transformers' own modules: importing transformers costs ~5 s per
process on a 2-core VM (torch._dynamo, torch.distributed.tensor and its hub
integrations come with it), ten times the 0.4 s the weights take to load, and
every `kvblend query` paid it. The numerics follow transformers' modules op for
op (fp32 norms, the rotary tables' matmul, Gemma's scaled embedding), and
tests/unit/test_transformer.py holds each supported family to them.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from kvblend.errors import ModelNotFoundError, UnsupportedModelError
from kvblend.model.config import ModelConfig, RopeSpec

# Modules are built on the meta device (no memory) and never initialised: their weights are about to be
# replaced by the checkpoint's. Hence the own Linear and Embedding below: torch's run a random init, which on
# the meta device goes through torch._refs and imports torch._dynamo (2.5 s on a 2-core VM, a quarter of a
# query), as `with torch.device("meta")` does.
META = torch.device("meta")


class Linear(nn.Module):
    """y = x·Wᵀ (+ b), with W [out, in] as checkpoints store it; no init."""

    def __init__(self, n_in: int, n_out: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in, device=META))
        self.bias = nn.Parameter(torch.empty(n_out, device=META)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMS norm in fp32. Gemma scales by (1 + weight) in fp32; Llama and Qwen by weight, after the cast back."""

    def __init__(self, dim: int, eps: float, gemma: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, device=META))
        self.eps = eps
        self.gemma = gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (x32 * (1.0 + self.weight.float())).type_as(x)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    """The q/k/v/o projections (+ q/k norms); attention itself is kvblend.model.attention's."""

    def __init__(self, config: ModelConfig, layer: int, bias: set[str]):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.q_proj = Linear(d, config.num_attention_heads * hd, bias="q_proj" in bias)
        self.k_proj = Linear(d, config.num_key_value_heads * hd, bias="k_proj" in bias)
        self.v_proj = Linear(d, config.num_key_value_heads * hd, bias="v_proj" in bias)
        self.o_proj = Linear(config.num_attention_heads * hd, d, bias="o_proj" in bias)
        if config.architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"):
            self.q_norm = RMSNorm(hd, config.rms_norm_eps, config.is_gemma)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps, config.is_gemma)
        self.scaling = (config.query_pre_attn_scalar or hd) ** -0.5
        self.sliding_window = config.window(layer)


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) · up(x)); SiLU, or Gemma's tanh-approximated GELU."""

    def __init__(self, config: ModelConfig, bias: set[str]):
        super().__init__()
        d, i = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(d, i, bias="gate_proj" in bias)
        self.up_proj = Linear(d, i, bias="up_proj" in bias)
        self.down_proj = Linear(i, d, bias="down_proj" in bias)
        act = config.hidden_act
        if act not in ("silu", "swish", "gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedModelError(f"{config.architecture}: activation {act!r} is not supported")
        self.gelu = act.startswith("gelu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP; Gemma adds a norm after each ("sandwich") and one before the MLP."""

    def __init__(self, config: ModelConfig, layer: int, bias: set[str]):
        super().__init__()
        eps, gemma = config.rms_norm_eps, config.is_gemma
        self.input_layernorm = RMSNorm(config.hidden_size, eps, gemma)
        self.self_attn = Attention(config, layer, bias)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, gemma)
        self.mlp = MLP(config, bias)
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, gemma)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, gemma)


class Embedding(nn.Module):
    """Token embedding; Gemma multiplies by sqrt(hidden), rounded to the weights' dtype first as it was trained."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, device=META))
        self.scale = math.sqrt(config.hidden_size) if config.is_gemma else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(ids, self.weight)
        if self.scale is None:
            return out
        return out * torch.tensor(self.scale, dtype=torch.float32).to(self.weight.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of each RoPE kind (Gemma 3: local layers base 10k, global ones 1M), computed in fp32.

    `kinds` lists the layer types in order of first use and `layer_kind[i]` is layer i's index in it;
    a one-kind model has kinds == [its layer type]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.kinds: list[str] = list(dict.fromkeys(config.layer_types))
        self.layer_kind = [self.kinds.index(t) for t in config.layer_types]
        # Plain fp32 tensors, not buffers: a model cast to bf16 must not round its RoPE frequencies.
        self.inv_freqs = [_inv_freq(config.rope[kind], config.head_dim) for kind in self.kinds]
        self._on_device: dict[tuple[int, torch.device], torch.Tensor] = {}

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kind: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, head_dim] for [B, T] positions, in x's dtype (the matmul transformers uses, in fp32)."""
        key = (kind, positions.device)
        if key not in self._on_device:
            self._on_device[key] = self.inv_freqs[kind].to(positions.device)
        expanded = self._on_device[key][None, :, None].expand(positions.shape[0], -1, 1)
        freqs = (expanded @ positions[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _inv_freq(spec: RopeSpec, head_dim: int) -> torch.Tensor:
    """Inverse frequencies of one RoPE kind (transformers' formulas for default, linear and llama3)."""
    inv_freq = 1.0 / (spec.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if spec.rope_type == "linear":
        return inv_freq / spec.factor
    if spec.rope_type == "llama3":
        old_context = spec.original_max_position_embeddings
        low_wavelen = old_context / spec.low_freq_factor
        high_wavelen = old_context / spec.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
        smooth = (old_context / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
        smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class Decoder(nn.Module):
    """Embedding, layers, final norm and the rotary tables: transformers' `model.model`."""

    def __init__(self, config: ModelConfig, bias: set[str]):
        super().__init__()
        self.embed_tokens = Embedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config, i, bias) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.is_gemma)


class Transformer(nn.Module):
    """A causal LM's weights: `model` (the decoder) and `lm_head`, under the checkpoint's names."""

    def __init__(self, config: ModelConfig, bias: set[str] = frozenset()):  # type: ignore[assignment]
        super().__init__()
        self.config = config
        self.model = Decoder(config, bias)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    @classmethod
    def from_state_dict(cls, config: ModelConfig, tensors: dict[str, torch.Tensor]) -> Transformer:
        """Build the modules on the meta device (see META) and take `tensors` as they are.

        Biases exist where the checkpoint has them (Qwen2's q/k/v, Llama's mlp_bias), which no config
        field says uniformly across families."""
        tensors = _unfused(config, tensors)
        bias = {name.split(".")[-2] for name in tensors if name.endswith(".bias")}
        model = cls(config, bias)
        tensors = dict(tensors)
        if "lm_head.weight" not in tensors and config.tie_word_embeddings:
            tensors["lm_head.weight"] = tensors.get("model.embed_tokens.weight")  # type: ignore[assignment]
        expected = set(model.state_dict())
        missing = sorted(name for name in expected if tensors.get(name) is None)
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise ModelNotFoundError(f"the checkpoint lacks weights the {config.architecture} layout needs: {shown}")
        model.load_state_dict({name: tensors[name] for name in expected}, strict=True, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.model.rotary_emb = RotaryEmbedding(config)  # fp32 tables on the CPU: built off the meta device
        return model.eval().requires_grad_(False)


def _unfused(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Phi-3's fused projections as the separate ones every other family has: `qkv_proj` is q, k and v stacked
    by rows, `gate_up_proj` the gate then the up projection (transformers' Phi3 slices them so). One layout
    for every family keeps the runner, the fusor and the weight formats family-blind; the split is views."""
    if not any(name.endswith((".qkv_proj.weight", ".gate_up_proj.weight")) for name in tensors):
        return tensors
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(".qkv_proj.weight"):
            stem = name.removesuffix("qkv_proj.weight")
            q, k, v = tensor.split([q_rows, kv_rows, kv_rows], dim=0)
            out |= {f"{stem}q_proj.weight": q, f"{stem}k_proj.weight": k, f"{stem}v_proj.weight": v}
        elif name.endswith(".gate_up_proj.weight"):
            stem = name.removesuffix("gate_up_proj.weight")
            gate, up = tensor.chunk(2, dim=0)
            out |= {f"{stem}gate_proj.weight": gate, f"{stem}up_proj.weight": up}
        else:
            out[name] = tensor
    return out


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's safetensors file(s). Pickled `.bin` weights are refused, never unpickled."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in directory.glob("*.bin"))
        if pickled:
            raise ModelNotFoundError(
                f"{directory} holds only pickled weights ({pickled[0]}); kvblend reads safetensors only "
                "(convert them, e.g. with transformers' save_pretrained(safe_serialization=True))"
            )
        raise ModelNotFoundError(f"no .safetensors weights in {directory}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors
