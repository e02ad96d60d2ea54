"""Run a causal LM one decoder layer at a time: this file is the forward pass.

CacheBlend needs to stop between layers (to pick HKVD tokens, to patch cached
KV, to wait for the next layer's KV from disk), which `model.forward` cannot do.
So the runner expresses a decoder layer as three steps over the checkpoint's
modules (kvblend.model.transformer: weights, norms, biases and rotary tables
under the checkpoint's own names):

    h ─► input_layernorm ─► q/k/v proj (+q_norm/k_norm) ─► RoPE     = project_qkv
      ─► attention of the chosen queries over the layer's full KV   = attend
      ─► o_proj + residual ─► post_attention_layernorm ─► MLP + res = finish_layer

and a whole forward pass is embed → (project_qkv → attend → finish_layer) per
layer → logits, as `prefill_batch` at the bottom of this file spells out.

Supported: Llama, Mistral, Qwen2 (q/k/v bias comes with the Linear modules),
Qwen3 (q_norm/k_norm before RoPE) and Gemma 3. Gemma 3 differs in four ways,
each handled where it acts rather than in a second runner:

* its embedding module scales by sqrt(hidden) itself (embed is unchanged);
* "sandwich" norms: attention and MLP outputs are normed before the residual
  add, and the MLP input has its own pre-norm (finish_layer);
* five of six layers attend within a sliding window, and those layers use
  their own RoPE base. `rope()` therefore returns one cos/sin table per *RoPE
  kind*, concatenated along the last axis ([B, T, kinds·head_dim]); every
  caller slices positions as before, and project_qkv / reposition take the
  layer's own kind. A one-kind model gets exactly the tensors it always did.
* a GELU MLP and q/k norms, which come with the model's own modules.

Anything else is refused by name (kvblend.model.source.check_architecture).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from kvblend.errors import UsageError
from kvblend.model import quant_kernels
from kvblend.model.attention import (
    QueryBlockPlanner,
    attention_probs,
    causal_bias,
    dense_causal,
    dense_suffix,
    is_short_suffix,
    last_query,
    sparse_queries,
)
from kvblend.model.config import ModelConfig
from kvblend.model.rope import Rotations, apply_rope, rotate_k
from kvblend.model.weights import WeightReport
from kvblend.types import LayerKV, Steps, drain


@dataclass
class ModelRunner:
    """A causal LM, exposed as embed → per-layer (project_qkv, attend, finish_layer) → logits."""

    model: Any  # a kvblend.model.transformer.Transformer: its submodules are reached by the checkpoint's names
    tokenizer: Any = None  # optional for pure-tensor use (tests); needed to tokenize and decode
    name: str = "model"
    fingerprint: str = ""
    local_layers_skip_sink: bool = True
    weights: WeightReport | None = None  # how the linear layers are held (kvblend.model.weights); None: as loaded
    cuda_graphs: bool = True  # on CUDA, decode steps replay captured graphs (False: `--enforce-eager`)
    # kvblend.model.fused_step.FusedStep: the CPU decode step in one C call, set by the loader where it takes
    # the model and weights (kvblend.generation.decode steps through it); None: every step is eager.
    fused_step: Any = None
    arch: str = field(init=False)

    def __post_init__(self) -> None:
        cfg: ModelConfig = self.model.config
        self.arch = cfg.architecture
        self.config = cfg
        self.decoder: Any = self.model.model
        self.layers: list[Any] = list(self.decoder.layers)
        self.n_layers = len(self.layers)
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.max_positions = cfg.max_position_embeddings
        self._windows = [cfg.window(i) for i in range(self.n_layers)]
        # Short local windows between global layers (Gemma 2/3): a passage past the first window never sees
        # the prompt's start in a local layer. A uniform window (Mistral's 4,096) covers whole prompts.
        self._mixes_windows = len(set(self._windows)) > 1 and None in self._windows
        # The fusor reuses one query set for many layers: its sparse-attention masks are memoised.
        self._blocks = QueryBlockPlanner(self.dtype)
        self._every: torch.Tensor | None = None  # _every_position's arange
        self._bias_memo: dict = {}
        rotary = self.decoder.rotary_emb
        # RoPE kinds: one per layer type (Gemma 3's local layers rotate with base 10k, its global ones with 1M).
        self._n_kinds = len(rotary.kinds)
        self._layer_kind: list[int] = list(rotary.layer_kind)
        # Re-rotation tables come from fp32 cos/sin: taken in a 16-bit compute dtype they would be
        # rounded before the fp32 rotation (bf16 keeps 8 bits: errors of 1e-2 on K).
        self._rotations = Rotations(lambda positions: self.rope(positions, torch.float32), self.head_dim)
        # Gemma's sandwich norms around attention and MLP (finish_layer); Gemma 2-style logit soft-capping.
        self._sandwich = hasattr(self.layers[0], "pre_feedforward_layernorm")
        self._final_softcap = cfg.final_logit_softcapping

    @contextmanager
    def decoding(self) -> Iterator[None]:
        """Inside: the projections read their converted weights (`--weights`) for calls of few rows, as a
        decode step's. Outside, and under fp32, every call reads the weights as loaded."""
        route = self.weights.route if self.weights is not None else None
        if route is None:
            yield
            return
        route.decoding = True
        try:
            yield
        finally:
            route.decoding = False

    @property
    def weights_name(self) -> str:
        """The weight format (`--weights`): "fp32" for weights as loaded, whatever the compute dtype."""
        return self.weights.weights if self.weights is not None else "fp32"

    @property
    def decode_kv_dtype(self) -> torch.dtype:
        """What a decode step's KV buffers hold (kvblend.generation.DecodeState): fp16 under int8, int4 or a
        GGUF's own blocks on the CPU, where kvblend's attention kernel reads 16-bit KV widened in registers (half the
        bytes a step streams: 30 layers of 3,656 keys took 5.4-6.0 ms against 9.7-10.6 ms in fp32 on a 2-core
        Zen 4 EPYC), where the kernel takes the model's shape; else the compute dtype, so `fp32` decodes the model's
        own forward pass (up to the order of the kernel's sums)."""
        quantized = self.weights_name in ("int8", "int4", "gguf")
        quantized = quantized and self.device.type == "cpu" and self.dtype == torch.float32
        kernels = quant_kernels.kernels() if quantized else None
        fits = kernels is not None and kernels.attention_fits(self.n_heads, self.n_kv_heads, self.head_dim)
        return torch.float16 if fits else self.dtype

    @property
    def dtype_name(self) -> str:
        """The compute dtype as reports and logs name it ("float32", "bfloat16")."""
        return str(self.dtype).removeprefix("torch.")

    # ── text ──
    @property
    def stop_token_ids(self) -> set[int]:
        """EOS and end-of-turn ids: generation stops on any of them."""
        ids: set[int] = set()
        ids.update(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        for marker in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>", "<end_of_turn>"):
            tid = self.tokenizer.convert_tokens_to_ids(marker)
            if tid is not None and tid != self.tokenizer.unk_token_id:
                ids.add(tid)
        return ids | self.line_break_ids

    @property
    def line_break_ids(self) -> frozenset[int]:
        """A base model's line-break tokens (no chat template; none for a chat model). It answers a completion
        prompt ("...Answer:") on one line, then goes on to write the next question itself: its answer ends at
        the line break, as in few-shot QA evaluation. Only once the answer has begun: Gemma 3's likeliest first
        token after "Answer:" is a line break, which ended four answers in six before any text. Every run of
        line breaks its vocabulary writes as one token counts (Gemma's has one for 1 to 31 of them)."""
        if getattr(self.tokenizer, "chat_template", None):
            return frozenset()
        cached = self.__dict__.get("_line_break_ids")
        if cached is None:
            encode: Any = getattr(self.tokenizer, "encode", None)  # absent on test stubs: no newline stops
            found = set()
            for n in range(1, 33) if encode is not None else ():
                tokens = encode("\n" * n, add_special_tokens=False)
                if len(tokens) == 1:
                    found.add(int(tokens[0]))
            cached = self.__dict__["_line_break_ids"] = frozenset(found)
        return cached

    def tokenize(self, text: str) -> list[int]:
        """Tokens of a text fragment, no special tokens added (fragments are concatenated)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def count_tokens(self, text: str) -> int:
        return len(self.tokenize(text))

    # ── the forward pass, step by step ──
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] ids → [B, T, D] hidden states."""
        return self.decoder.embed_tokens(token_ids)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for [B, T] absolute positions from the model's own rotary embedding (in `dtype`,
        default the compute dtype: the embedding computes in fp32 and casts to its input's dtype).

        A model with several RoPE kinds (Gemma 3) gets each kind's table side by side on the last axis,
        [B, T, kinds·head_dim]: callers index and slice positions as for one kind, and the layer's own
        kind is picked where it is applied (project_qkv)."""
        probe = torch.empty(0, device=self.device, dtype=dtype or self.dtype)
        tables = [self.decoder.rotary_emb(probe, positions, kind) for kind in range(self._n_kinds)]
        if len(tables) == 1:
            return tables[0]
        return torch.cat([c for c, _ in tables], dim=-1), torch.cat([s for _, s in tables], dim=-1)

    @property
    def rope_kinds(self) -> int:
        """How many RoPE tables `rope()` returns side by side (2 for Gemma 3, else 1)."""
        return self._n_kinds

    def rope_kind(self, layer: int) -> int:
        """Which of `rope()`'s tables this layer rotates with."""
        return self._layer_kind[layer]

    def _layer_rope(self, layer: int, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's part of a `rope()` table (the whole table for a one-kind model)."""
        if self._n_kinds == 1:
            return cos, sin
        part = slice(self._layer_kind[layer] * self.head_dim, (self._layer_kind[layer] + 1) * self.head_dim)
        return cos[..., part], sin[..., part]

    def project_qkv(
        self, layer: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pre-norm, q/k/v projections (+ Qwen3's and Gemma 3's q_norm/k_norm), RoPE. → [B, heads, T, hd]."""
        block = self.layers[layer]
        cos, sin = self._layer_rope(layer, cos, sin)
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
        return apply_rope(q, c, s), apply_rope(k, c, s), v

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
        scale = self.attention_scale(layer)
        window = self._windows[layer]
        n_keys = k.shape[2]
        dense = window is None or window >= n_keys
        decoding = query_positions is not None and q.shape[2] == 1 and int(query_positions[-1]) == n_keys - 1
        if query_positions is None and dense:
            out = dense_causal(q, k, v, scale)
        elif decoding:  # the newest position sees every key (of its window), no mask to build
            keys = slice(max(0, n_keys - window), n_keys) if window is not None else slice(0, n_keys)
            out = last_query(q, k[:, :, keys], v[:, :, keys], scale)
        elif dense and query_positions is not None and is_short_suffix(query_positions, n_keys):
            out = dense_suffix(q, k, v, scale)
        else:
            if query_positions is None:  # every position, under a window shorter than the keys
                query_positions = self._every_position(n_keys, q.device)
            out = sparse_queries(q, k, v, self._blocks.plan(query_positions, n_keys, window), scale)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)

    def _every_position(self, n_keys: int, device: torch.device) -> torch.Tensor:
        """arange(n_keys), one tensor per length: a windowed layer's block plan is memoised by the query
        tensor's identity, so every local layer of one prefill reuses the plan the first one built."""
        every = self._every
        if every is None or every.numel() != n_keys or every.device != device:
            every = self._every = torch.arange(n_keys, device=device)
        return every

    def attention_weights(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        query_positions: torch.Tensor,
        hidden_keys: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The probabilities `attend` would use: [B, heads, Tq, Tk] in fp32 (few queries only). `hidden_keys`
        ([Tk] bool): keys left out as if absent (the probe's: positions it does not compute)."""
        scale = self.attention_scale(layer)
        window = self._windows[layer]
        memo = self._bias_memo  # the probe asks with one query set for every layer: masks built once
        if (
            memo.get("positions") is not query_positions
            or memo.get("keys") != k.shape[2]
            or memo.get("hidden") is not hidden_keys
        ):
            memo.clear()
            memo.update(positions=query_positions, keys=k.shape[2], hidden=hidden_keys)
        if window not in memo:
            bias = causal_bias(query_positions, k.shape[2], window)
            memo[window] = bias if hidden_keys is None else bias.masked_fill_(hidden_keys[None], float("-inf"))
        return attention_probs(q, k, memo[window], scale)

    def attention_scale(self, layer: int) -> float:
        """The layer's attention softmax scale (Gemma: query_pre_attn_scalar ** -0.5, else 1/sqrt(head_dim))."""
        return float(self.layers[layer].self_attn.scaling)

    def window(self, layer: int) -> int | None:
        """The layer's sliding window in tokens (None: it sees every earlier key)."""
        return self._windows[layer]

    def finish_layer(self, layer: int, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """o_proj + residual, then post-attention norm, MLP and residual.

        Gemma's sandwich: the attention output is normed before the residual add
        (its `post_attention_layernorm`), and the MLP has a pre- and a post-norm."""
        block = self.layers[layer]
        if self._sandwich:
            h = residual + block.post_attention_layernorm(block.self_attn.o_proj(attn_out))
            return h + block.post_feedforward_layernorm(block.mlp(block.pre_feedforward_layernorm(h)))
        h = residual + block.self_attn.o_proj(attn_out)
        return h + block.mlp(block.post_attention_layernorm(h))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the given hidden states (usually only the last token), soft-capped where
        the model caps its logits."""
        logits = self.model.lm_head(self.decoder.norm(hidden)).float()
        if self._final_softcap:
            logits = torch.tanh(logits / self._final_softcap) * self._final_softcap
        return logits

    # ── RoPE re-positioning of cached K ──
    def reposition(self, k: torch.Tensor, delta: int, out: torch.Tensor | None = None, layer: int = 0) -> torch.Tensor:
        """Rotate post-RoPE K of `layer` by `delta` positions: R(p+Δ) = R(Δ)·R(p). Computed in fp32.

        The layer picks the RoPE kind (Gemma 3's local and global bases); with `out` the
        result is written there (see kvblend.model.rope.rotate_k).
        """
        if delta == 0:
            return k if out is None else out.copy_(k)
        cos, sin = self._rotations(delta, k.device, self._layer_kind[layer])
        return rotate_k(k, cos, sin, out)

    # ── plain prefill, batched (used for segment precompute and as the `full` reference) ──
    def prefill_batch(
        self, batch: list[list[int]], start_position: int = 0, past: list[LayerKV] | None = None
    ) -> list[list[LayerKV]]:
        """Prefill several token lists alone and return each one's per-layer KV (see :meth:`prefill_steps`)."""
        return drain(self.prefill_steps(batch, start_position, past))

    @torch.inference_mode()
    def prefill_steps(
        self,
        batch: list[list[int]],
        start_position: int = 0,
        past: list[LayerKV] | None = None,
        rows_per_step: int | None = None,
    ) -> Steps[list[list[LayerKV]]]:
        """Prefill several token lists alone, padded right, and return each one's per-layer KV.

        Right padding needs no extra mask: a real token never attends forward, so pads
        cannot leak into it. With `past` (per layer [kv_heads, P, hd] on the compute device: the
        KV of P tokens just before `start_position`, e.g. a sink prefix that every row continues)
        the rows attend to those tokens too; the prefix is computed once for the whole batch
        instead of once per row, and only the rows' own KV comes back.
        KV comes back as [kv_heads, n, head_dim] per layer, on the compute device. It yields
        after every layer, so a server can interleave it with other requests' decode steps, and with
        `rows_per_step` also inside a layer, every `rows_per_step` tokens, so a server's running streams
        wait for at most that much of one layer (vLLM's chunked prefill); None: whole layers, bit for bit
        as before. The caller passes it per call: a runner holds no setting of a server's.
        The last layer's attention and MLP are skipped: only its K/V are kept, and they come
        from its input (1/n_layers of the work, for nothing).
        """
        if not batch or any(len(ids) == 0 for ids in batch):
            raise UsageError("cannot prefill an empty segment")
        n_past = past[0][0].shape[1] if past else 0
        if n_past > start_position:
            raise ValueError(f"{n_past} past tokens cannot end at position {start_position}")
        width = max(len(ids) for ids in batch)
        pad = getattr(self.tokenizer, "pad_token_id", None) or 0
        ids = torch.full((len(batch), width), pad, dtype=torch.long, device=self.device)
        for row, tokens in enumerate(batch):
            ids[row, : len(tokens)] = torch.tensor(tokens, device=self.device)
        positions = torch.arange(start_position, start_position + width, device=self.device)
        key_index = positions - (start_position - n_past)  # the queries' rows in [past; batch] keys
        cos, sin = self.rope(positions.expand(len(batch), -1))
        hidden = self.embed(ids)
        out: list[list[LayerKV]] = [[] for _ in batch]
        chunks = row_chunks(width, rows_per_step)
        for layer in range(self.n_layers):
            last = layer == self.n_layers - 1
            if len(chunks) == 1:
                q, k, v = self.project_qkv(layer, hidden, cos, sin)
                if not last:
                    seen = self._past_seen(past, layer)
                    keys, values = _after_past(seen, layer, k, v)
                    attn = self.attend(layer, q, keys, values, key_index if seen else None)
                    hidden = self.finish_layer(layer, hidden, attn)
            else:  # by token ranges: every key is computed first, then each range's queries attend causally
                parts = []
                for rows in chunks:
                    parts.append(self.project_qkv(layer, hidden[:, rows], cos[:, rows], sin[:, rows]))
                    yield None
                q, k, v = (torch.cat(t, dim=2) for t in zip(*parts))
                if not last:  # of the last layer only its K/V are kept
                    seen = self._past_seen(past, layer)
                    keys, values = _after_past(seen, layer, k, v)
                    rows_index = key_index if seen else key_index - n_past
                    done = []
                    for rows in chunks:
                        attn = self.attend(layer, q[:, :, rows], keys, values, query_positions=rows_index[rows])
                        done.append(self.finish_layer(layer, hidden[:, rows], attn))
                        yield None
                    hidden = torch.cat(done, dim=1)
            for row, tokens in enumerate(batch):
                out[row].append((k[row, :, : len(tokens)], v[row, :, : len(tokens)]))
            yield None
        return out

    def _past_seen(self, past: list[LayerKV] | None, layer: int) -> list[LayerKV] | None:
        """The shared past a segment's tokens attend to in `layer`: none in a local layer of a model
        that mixes local and global layers (`local_layers_skip_sink` False: every layer sees it).

        In a prompt, a passage sits behind other passages: in a local layer its tokens see only the
        tail of the passage before, never the sink at the prompt's start (the first 512 tokens aside).
        Prefilled after the sink with the sink in view, every token of a Gemma 3 passage leaned on that
        BOS in five of six layers, and its KV deviated from the prompt's everywhere: blend at 0.3 was no
        closer to full than reuse. The sink is therefore seen in global layers only.
        """
        if past is None or self._windows[layer] is None or not self._mixes_windows or not self.local_layers_skip_sink:
            return past
        return None


def _after_past(past: list[LayerKV] | None, layer: int, k: torch.Tensor, v: torch.Tensor) -> LayerKV:
    """The batch's K/V [B, kv_heads, n, hd] preceded by the shared past's of this layer, for every row."""
    if not past:
        return k, v
    past_k, past_v = past[layer]
    rows = k.shape[0]
    return (
        torch.cat([past_k.unsqueeze(0).expand(rows, -1, -1, -1), k], dim=2),
        torch.cat([past_v.unsqueeze(0).expand(rows, -1, -1, -1), v], dim=2),
    )


def row_chunks(n: int, rows: int | None) -> list[slice]:
    """[0, n) in ranges of at most `rows` (None or 0: one range)."""
    if not rows or n <= rows:
        return [slice(0, n)]
    return [slice(i, min(n, i + rows)) for i in range(0, n, rows)]
