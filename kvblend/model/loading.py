"""Loading a checkpoint as a ModelRunner: device and dtype choice, GGUF conversion, architecture check.

transformers is imported only to de-quantise a GGUF into a safetensors checkpoint,
once per file (the result is kept in the model cache); every later load reads
that checkpoint without it.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from kvblend.defaults import NATIVE_WEIGHTS
from kvblend.errors import ModelNotFoundError, UsageError
from kvblend.model import quant_kernels
from kvblend.model.config import ModelConfig
from kvblend.model.fused_step import fused_step
from kvblend.model.gguf_blocks import plain_array_reader
from kvblend.model.runner import ModelRunner
from kvblend.model.source import (
    SUPPORTED_ARCHITECTURES,
    ModelSource,
    check_architecture,
    check_gguf_architecture,
    check_gguf_weights,
    model_cache_dir,
    resolve_model_source,
    source_fingerprint,
)
from kvblend.model.tokenizer import TextTokenizer
from kvblend.model.transformer import Transformer, read_safetensors
from kvblend.model.weights import (
    DEFAULT_DECODE_ROWS,
    GGUF_WEIGHTS,
    apply_weights,
    check_weights,
    file_blocks,
    native_format,
)

#: Where a converted GGUF's decode blocks are kept (kvblend.model.gguf_blocks, the int4/int8 conversions): a
#: folder of its own, since the checkpoint is every *.safetensors beside config.json (read_safetensors).
DECODE_BLOCKS = "decode-blocks"

__all__ = ["SUPPORTED_ARCHITECTURES", "check_architecture", "load_model", "pick_compute_device", "pick_dtype"]


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
    names = {
        "fp32": torch.float32,
        "float32": torch.float32,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
    }
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in names:
        raise UsageError(f"--dtype must be one of fp32, bf16, fp16, not {dtype!r}")
    return names[dtype]


def load_model(
    model: str | None = None,
    compute: str | None = None,
    dtype: str | None = None,
    weights: str | None = None,
    decode_rows: int = DEFAULT_DECODE_ROWS,
    cuda_graphs: bool = True,
) -> ModelRunner:
    """Load a checkpoint (default: the bundled SmolLM2 GGUF) as a layer-by-layer runner.

    config.json, safetensors and tokenizer.json are read directly (kvblend.model.config,
    .transformer, .tokenizer); transformers is imported only to convert a GGUF the first time.
    `weights` gives the linear layers a converted copy that decode batches of up to `decode_rows` read
    (kvblend.model.weights; "auto" is resolved by the caller, from a stored profile, and to NATIVE_WEIGHTS without
    one: the checkpoint's own format where kvblend's CPU kernels run it exactly). `cuda_graphs` False
    (`--enforce-eager`) decodes on CUDA without graphs (kvblend.generation.decode.StaticStep).
    """
    weights = check_weights(weights, allow_auto=False, allow_native=True)
    source = resolve_model_source(model)
    if source.gguf_file:  # from the header, in milliseconds: never after a conversion of half a minute
        check_gguf_architecture(source.directory / source.gguf_file)
    check_gguf_weights(source, weights)
    fingerprint = source_fingerprint(source)
    with _unreadable_checkpoint(source):
        directory = _converted_gguf_dir(source, fingerprint) if source.gguf_file else source.directory
        config = ModelConfig.read(directory)  # refuses an architecture or RoPE we cannot run, before any weights
    device = pick_compute_device(compute)
    if device.type == "cuda":
        avoid_cudnn_attention()
    torch_dtype = pick_dtype(device, dtype)
    if weights == GGUF_WEIGHTS and (
        device.type != "cpu" or torch_dtype != torch.float32 or not quant_kernels.kernels()
    ):
        raise UsageError("--weights gguf runs on the CPU in fp32, with kvblend's CPU kernels (a C compiler)")
    with _unreadable_checkpoint(source):
        tokenizer = TextTokenizer.read(directory)
        transformer = Transformer.from_state_dict(config, read_safetensors(directory))
    transformer.to(device=device, dtype=torch_dtype)
    if device.type == "cpu":
        quant_kernels.kernels()  # built now (about a second, once per machine), not in the first decode step
    blocks, asked = None, weights
    if weights in (NATIVE_WEIGHTS, GGUF_WEIGHTS):  # the checkpoint's own blocks (Q4_1 and Q8_0 files: int4, int8)
        weights = native_format(transformer)
        if weights == "fp32" and source.gguf_file:  # a GGUF of mixed block types (Q4_K_M, ...): its own blocks
            gguf = source.directory / source.gguf_file
            heads = (config.num_attention_heads, config.num_key_value_heads)
            blocks = file_blocks(transformer, gguf, directory / DECODE_BLOCKS / "gguf.safetensors", *heads)
            weights = GGUF_WEIGHTS if blocks else weights
        if weights == "fp32" and asked == GGUF_WEIGHTS:  # asked for by name: say why it cannot be
            raise UsageError(
                f"--weights gguf: {source.name}'s projections are not all in blocks kvblend's CPU kernels multiply "
                "exactly (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K), or this is not the CPU; use int8 or int4 to re-quantise"
            )
    # a GGUF's conversion to int4/int8 is kept beside its converted checkpoint (directory: this file's own)
    report = apply_weights(
        transformer, weights, decode_rows, blocks, directory / DECODE_BLOCKS if source.gguf_file else None
    )
    runner = ModelRunner(
        transformer, tokenizer, name=source.name, fingerprint=fingerprint, weights=report, cuda_graphs=cuda_graphs
    )
    runner.fused_step = fused_step(runner)
    return runner


def avoid_cudnn_attention() -> None:
    """Take cuDNN out of torch's attention backends (process-wide): its plans are built per shape, and
    kvblend's shapes are new all the time (each prompt's length, each decode step's key count).

    On an H100 (torch 2.11, bf16, SmolLM2's shape at ~3,000 tokens; bench-out/device_check_sdpa.json):
    a blend fusion at a prompt length not seen before took 387-2,917 ms with cuDNN and 109-118 ms
    without; an eager decode step at new key counts 51-52 ms against 17-18 ms. With every shape
    already seen cuDNN was faster for blend (71-81 ms against 107-116), but a server or CLI rarely
    sees a length twice. Flash, memory-efficient and math attention need no per-shape plan."""
    torch.backends.cuda.enable_cudnn_sdp(False)


@contextmanager
def _unreadable_checkpoint(source: ModelSource) -> Iterator[None]:
    """A checkpoint transformers cannot read (not GGUF, truncated, bad config) is one line, not a traceback.

    Only the loading calls run inside this: their errors come from the user's
    file, whatever type transformers or safetensors chose for them.
    """
    try:
        yield
    except (OSError, ValueError, KeyError, EOFError, RuntimeError, SafetensorError) as e:
        shown = source.directory / source.gguf_file if source.gguf_file else source.directory
        raise ModelNotFoundError(f"cannot load model from {shown}: {_reason(e)}") from None


def _reason(e: BaseException) -> str:
    """An error's first line, with the line after it where the first only announces it ("Error(s) in loading
    state_dict for Transformer:" said nothing of which weight did not fit its config)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()] or [type(e).__name__]
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def _converted_gguf_dir(source: ModelSource, fingerprint: str) -> Path:
    """Load a GGUF once, de-quantise, and keep an HF copy so later loads take ~0.5 s, not the 8-22 s a conversion takes.

    The copy goes to the model cache; a user whose cache cannot be written (no home, a
    read-only home) gets it under the system temp directory instead of an error.
    """
    converted = cached_conversion(source.name, fingerprint)
    if converted is not None:
        return converted
    name = f"{source.name}-{fingerprint}"
    for base in _cache_candidates():
        try:
            base.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(base, os.W_OK | os.X_OK) and _own_or_configured(base):
            return _convert_gguf(source, base / name)
    raise ModelNotFoundError(f"no writable directory for the converted model (tried {model_cache_dir()})")


def cached_conversion(name: str, fingerprint: str) -> Path | None:
    """The checkpoint a GGUF was converted into, if the model cache (or its temp fallback) holds it: under
    this name, else under any other name of the same file (the fingerprint is the file's): the bundled GGUF
    given by its path was de-quantised again (~30 s, 1.3 GB more) beside its conversion by package name."""
    for base in _cache_candidates():
        if not base.is_dir() or not _own_or_configured(base):
            continue
        for target in (base / f"{name}-{fingerprint}", *sorted(base.glob(f"*-{fingerprint}"))):
            if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
                return target
    return None


def _cache_candidates() -> list[Path]:
    """The model cache, then a per-user directory under the system temp directory."""
    return [model_cache_dir(), Path(tempfile.gettempdir()) / f"kvblend-models-{os.getuid()}"]


def _own_or_configured(base: Path) -> bool:
    """The temp fallback must be ours: a directory another user made there could hold anything."""
    return base == model_cache_dir() or base.stat().st_uid == os.getuid()


def _convert_gguf(source: ModelSource, target: Path) -> Path:
    """De-quantise the GGUF into an HF checkpoint at `target` (staged, then renamed into place)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress goes to stderr; theirs would clutter it
    hf_logging.set_verbosity_error()
    if sys.stderr.isatty():  # half a minute for Gemma 3 with nothing else said; never in a script's stderr
        print(
            f"kvblend: converting {source.gguf_file} for its first use (once; kept in {target.parent})",
            file=sys.stderr,
            flush=True,
        )
    with _gguf_parsed_once():
        model, info = AutoModelForCausalLM.from_pretrained(
            source.directory, gguf_file=source.gguf_file, dtype=torch.float32, output_loading_info=True
        )
        tied = getattr(model.config, "tie_word_embeddings", False)
        missing = [k for k in info.get("missing_keys", ()) if not (tied and k == "lm_head.weight")]
        if missing:  # transformers filled them with random weights, and said so only in a warning
            raise ModelNotFoundError(
                f"{source.directory / str(source.gguf_file)} lacks {len(missing)} of the model's weights "
                f"(e.g. {sorted(missing)[0]}): is it a part of a split model, or cut short?"
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
    except (OSError, SafetensorError) as e:  # safetensors says "No space left on device" as its own error
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise ModelNotFoundError(f"cannot write the converted model to {target.parent}: {_reason(e)}") from None
    return target


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """While converting, parse the GGUF file once and build each tensor-name map once.

    transformers reads the file three times (config, weights, tokenizer), each a
    ~4 s parse of its 49k-entry vocabulary on a 2-core VM, and builds the same
    name map once per module (~400 times, ~5.5 s): the first run of a fresh
    install took ~19 s to convert. Both are pure functions of their arguments,
    which transformers looks up on the `gguf` module at call time, so memoising
    them there for the duration of the conversion changes nothing but the time.
    The one parse is also made 3x faster (`_plain_array_reader`): SmolLM2's conversion now takes 8.4 s
    and Gemma 3's 21.8 s, against 11.4 and 35.8 s (2-core AMD EPYC; the converted files are byte-identical).
    """
    import gguf

    originals = {name: getattr(gguf, name) for name in ("GGUFReader", "get_tensor_name_map")}
    replacements = {
        "GGUFReader": plain_array_reader(originals["GGUFReader"]),
        "get_tensor_name_map": originals["get_tensor_name_map"],
    }
    for name, replacement in replacements.items():
        setattr(gguf, name, _memoised(replacement))
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    parse_value, bar = hf_gguf._gguf_parse_value, hf_gguf.tqdm
    hf_gguf._gguf_parse_value = _fast_parse_value
    # Its tensor loop draws a tqdm bar of its own, which `disable_progress_bar` does not reach: into a
    # `--json` run's stderr too.
    hf_gguf.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(gguf, name, original)
        hf_gguf._gguf_parse_value, hf_gguf.tqdm = parse_value, bar


_GGUF_INTS, _GGUF_FLOATS, _GGUF_BOOL, _GGUF_STRING, _GGUF_ARRAY = {0, 1, 2, 3, 4, 5, 10, 11}, {6, 12}, 7, 8, 9


def _fast_parse_value(value: Any, data_type: Any) -> Any:
    """transformers' `_gguf_parse_value` (one GGUF field element as a Python value), with the same values and
    errors. It runs once per element of the vocabulary's arrays (2.4 million times for Gemma 3's 262k tokens),
    and the original turned each token's bytes into a list of NumPy scalars to build them again: Gemma 3's
    conversion takes 13.6-15.6 s with this against 17.1-17.8 s, SmolLM2's 5.3 against 6.1 s, to the same bytes
    (2-core Zen 4 EPYC, interleaved)."""
    if isinstance(data_type, list):
        if len(data_type) == 1:
            data_type = data_type[0]
        elif data_type[0] != _GGUF_ARRAY:
            raise ValueError("Received multiple types, therefore expected the first type to indicate an array.")
        else:
            data_type = data_type[1]
    if data_type in _GGUF_INTS:
        return int(value[0])
    if data_type in _GGUF_FLOATS:
        return float(value[0])
    if data_type == _GGUF_BOOL:
        return bool(value[0])
    if data_type == _GGUF_STRING:
        return value.tobytes().decode()
    return value


def _memoised(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` answering each distinct call (arguments compared by their text) once."""
    results: dict[tuple, Any] = {}

    def call(*args: Any, **kwargs: Any) -> Any:
        key = (tuple(str(a) for a in args), tuple(sorted((k, str(v)) for k, v in kwargs.items())))
        if key not in results:
            results[key] = function(*args, **kwargs)
        return results[key]

    return call
