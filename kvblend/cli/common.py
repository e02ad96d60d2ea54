"""Shared CLI plumbing: options every command takes, consoles, JSON output, size parsing."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import typer
from rich import filesize
from rich.console import Console

from kvblend.archive import Archive, Location, resolve_location
from kvblend.errors import ArchiveError, UsageError

# Results go to stdout; progress, tables for humans on stderr when stdout is data.
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

ArchiveOpt = typer.Option(
    None,
    "--archive",
    "-a",
    help="Archive: a directory, or redis://[user[:password]@]host:port[/db] (rediss:// for TLS); default $KVBLEND_ARCHIVE, else $XDG_CACHE_HOME/kvblend (~/.cache/kvblend).",
    show_default=False,
)
ModelOpt = typer.Option(
    None,
    "--model",
    "-m",
    help="HF checkpoint directory, .gguf file, or a bundled model: gemma3-270m (default: bundled SmolLM2-135M-Instruct).",
    show_default=False,
)
ComputeOpt = typer.Option(
    None, "--compute", help="Compute device: cpu or cuda (default: cuda when present).", show_default=False
)
DtypeOpt = typer.Option(
    None,
    "--dtype",
    help="Compute dtype: fp32, bf16, fp16, or auto (what a `kvblend profile` stored in this archive measured fastest on this machine) (default: fp32 on CPU, bf16 on CUDA); KV is archived in bf16 under bf16, else fp16, and keyed by it.",
    show_default=False,
)
WeightsOpt = typer.Option(
    None,
    "--weights",
    help="Weights decode steps read: fp32, bf16, int8, int4 (the GGUF's Q4_1 codes), gguf (a GGUF's own blocks, exactly: Q4_K_M and other mixed files) or auto (default: what a `kvblend profile` stored in this archive measured fastest on this machine; if none did, the checkpoint's own format where kvblend's CPU kernels run it exactly, a Q4_1 GGUF's int4 or a Q4_K_M GGUF's gguf, else fp32). Prefill and the archived KV always use the weights as loaded.",
    show_default=False,
)
EagerOpt = typer.Option(
    False,
    "--enforce-eager",
    help="Decode without CUDA graphs (vLLM's flag): every step's kernels launched one by one, slower on a GPU; for debugging. No effect on the CPU.",
)
JsonOpt = typer.Option(False, "--json", help="Print one JSON object on stdout (for scripts).")
WaitOpt = typer.Option(False, "--wait", help="Wait for another writer to finish instead of exiting.")


def decode_settings(
    weights: str | None,
    archive: str | Path | None,
    model: str | None,
    compute: str | None,
    enforce_eager: bool = False,
) -> dict[str, Any]:
    """`--weights` and `--enforce-eager` as Engine keywords: a format as given, or for `auto` (the default) what
    the profiles stored in the archive measured fastest on this machine for this model (where none did, NATIVE_WEIGHTS:
    the checkpoint's own format where kvblend's CPU kernels run it exactly, else fp32)."""
    eager = {"cuda_graphs": False} if enforce_eager else {}
    if weights not in (None, "auto"):
        if weights == "gguf":  # the file's own blocks, by name: refused for a checkpoint directory before any write
            from kvblend.model.source import check_gguf_weights, resolve_model_source

            check_gguf_weights(resolve_model_source(model), weights)
        return {"weights": weights, **eager}
    from kvblend.defaults import NATIVE_WEIGHTS
    from kvblend.tuning.profile import weights_choice

    chosen, rows = weights_choice(*_profiled(archive, model), compute)
    # a profile's "gguf": the file's own blocks where this run can take them (another dtype, no kernels: fp32)
    return {"weights": NATIVE_WEIGHTS if chosen == "gguf" else chosen, "decode_rows": rows, **eager}


def compute_dtype(dtype: str | None, archive: str | Path | None, model: str | None, compute: str | None) -> str | None:
    """`--dtype` as the model loads it: a dtype as given, the device's default when unset, and for `auto` what
    the profiles stored in the archive measured fastest on this machine for this model (the default where none
    did)."""
    if dtype != "auto":
        return dtype
    from kvblend.tuning.profile import dtype_choice

    return dtype_choice(*_profiled(archive, model), compute)


def _profiled(archive: str | Path | None, model: str | None) -> tuple[Location, str]:
    """Where `auto` looks for profiles and for which model: the archive's location and the model's fingerprint
    (from its files' identity, nothing loaded)."""
    from kvblend.model.source import resolve_model_source, source_fingerprint

    return resolve_location(archive), source_fingerprint(resolve_model_source(model))


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def printable(text: str) -> str:
    """`text` with its control characters as escapes (`\\n`, `\\x01`): a newline in a file's name would break a
    one-line message in two, or a table row."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def progress_enabled(as_json: bool) -> bool:
    """Progress bars only for a human at a terminal."""
    return not as_json and sys.stderr.isatty() and os.environ.get("CI") != "true"


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(bytes?|[kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def parse_size(text: str) -> int:
    """'5GB' → 5e9 bytes, '512MiB' → 512·2^20."""
    m = _SIZE.match(text or "")
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise UsageError(f"not a size: {text!r} (try 500MB, 5GB, 1GiB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def given_options(ctx: Any, *names: str) -> list[str]:
    """Of the parameters `names`, the flags (``--top-p``) the user gave on the command line or through the
    environment, not left at their defaults (typer vendors click: its ParameterSource is known by name)."""
    sources = {name: ctx.get_parameter_source(name) for name in names}
    return [
        "--" + name.replace("_", "-")
        for name, source in sources.items()
        if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")
    ]


def no_effect(flags: list[str], why: str) -> str:
    """The warning for options a command's other choices leave without effect: "--a, --b have no effect WHY"."""
    return f"{', '.join(flags)} {'has' if len(flags) == 1 else 'have'} no effect {why}"


def parse_budget(text: str, flag: str) -> int:
    """A size limit given as `flag`: at least one byte (0 would evict or refuse everything, surely a slip)."""
    size = parse_size(text)
    if size < 1:
        raise UsageError(f"{flag} must be more than 0 bytes, not {text!r}")
    return size


def human_bytes(n: float) -> str:
    """A size in SI units, as Rich writes them ("512 bytes", "1.2 kB", "3.4 MB"): the units parse_size reads."""
    return filesize.decimal(int(n))


def parse_check_layers(text: Optional[str]) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        layers = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--check-layers takes comma-separated layer numbers, not {text!r}") from None
    if not layers:
        raise UsageError("--check-layers needs at least one layer")
    return layers


@contextmanager
def archive_dir_or_scratch(given: Optional[str | Path], prefix: str) -> Iterator[tuple[str | Path, bool]]:
    """(archive, is_scratch): the archive the user named (a directory or a URL), else a temporary directory
    removed afterwards."""
    if given is not None:
        yield given, False
        return
    scratch = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield scratch, True
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def open_existing(archive: Optional[str], write: bool = False) -> Archive:
    """Open an existing archive: read-only unless the command changes it (never creates one)."""
    location = resolve_location(archive)
    if location.path is not None and not location.path.exists():
        raise ArchiveError(f"no archive at {location} (run `kvblend ingest PATH` first, or pass --archive)")
    return Archive.open(location, create=False, readonly=not write)
