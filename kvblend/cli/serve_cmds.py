"""`kvblend serve`: parsing only; the server is kvblend.serve's.

kvblend.serve (FastAPI, uvicorn, torch) is imported inside the command, so
`kvblend --help` and the archive commands never load it.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import typer

from kvblend.cli.common import (
    ArchiveOpt,
    ComputeOpt,
    DtypeOpt,
    EagerOpt,
    ModelOpt,
    WeightsOpt,
    compute_dtype,
    decode_settings,
    parse_budget,
)
from kvblend.defaults import DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE, DEFAULT_MAX_STORED_TOKENS, DEFAULT_SHUTDOWN_GRACE_S
from kvblend.errors import UsageError
from kvblend.options import ComputeDtype, WeightsFormat

API_KEY_ENV = "KVBLEND_API_KEY"
MAX_BATCH = 4096  # sequences in one decode step: far past what any machine here decodes at once
MAX_SHUTDOWN_GRACE_S = 86_400  # a day: a timer far beyond that overflows the clock's timeout


def register(app: typer.Typer) -> None:
    app.command()(serve)


def serve(
    host: str = typer.Option(
        "127.0.0.1",
        "--host",
        help="Address to listen on. 0.0.0.0 listens on every interface: the server is then reachable by anyone who can reach the port, so give it an --api-key.",
    ),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    max_queue: int = typer.Option(
        DEFAULT_MAX_QUEUE,
        "--max-queue",
        help="Requests that may wait for a place in the batch; one more is answered 429.",
    ),
    max_batch: int = typer.Option(
        DEFAULT_MAX_BATCH,
        "--max-batch",
        help="Sequences decoded together in one forward pass (continuous batching); a new request joins when one leaves.",
    ),
    api_key: Optional[str] = typer.Option(
        None,
        "--api-key",
        help=f"Require this key as a Bearer token on every route but /health (default: ${API_KEY_ENV}; none: no authentication).",
        show_default=False,
    ),
    max_archive_size: Optional[str] = typer.Option(
        None,
        "--max-archive-size",
        help="Keep the archive's payloads under this size while serving, e.g. 500MB: least-recently-used segments are evicted (as `gc --max-size`).",
        show_default=False,
    ),
    max_stored_tokens: int = typer.Option(
        DEFAULT_MAX_STORED_TOKENS,
        "--max-stored-tokens",
        help="New passages one request may store, in tokens; beyond it they are computed in the prompt, not stored (0: store none).",
    ),
    shutdown_grace: float = typer.Option(
        DEFAULT_SHUTDOWN_GRACE_S,
        "--shutdown-grace",
        help="Seconds the requests in flight get to finish after SIGTERM or Ctrl-C; then their streams end with an error event (as uvicorn's --timeout-graceful-shutdown).",
    ),
    archive: Optional[str] = ArchiveOpt,
    model: Optional[str] = ModelOpt,
    compute: Optional[str] = ComputeOpt,
    dtype: Optional[ComputeDtype] = DtypeOpt,
    weights: Optional[WeightsFormat] = WeightsOpt,
    enforce_eager: bool = EagerOpt,
) -> None:
    """Serve an OpenAI-compatible API (/v1/chat/completions, /v1/completions) that reuses archived KV.

    Questions alone are answered from the archive's top-k segments; passages sent in the
    user message (text parts, or blocks split by <<<chunk>>>) reuse their archived KV,
    and a passage not yet archived is computed and stored for the next request.
    Requests that decode share one forward pass per step (continuous batching).
    Logs go to stderr; SIGTERM or Ctrl-C shut down gracefully.
    """
    if not 1 <= port <= 65535:
        raise UsageError(f"--port must be between 1 and 65535, not {port}")
    if max_queue < 1:
        raise UsageError("--max-queue must be at least 1")
    if not 1 <= max_batch <= MAX_BATCH:  # (10^20 was taken, and sized what decode allocates)
        raise UsageError(f"--max-batch must be between 1 and {MAX_BATCH}, not {max_batch}")
    if max_stored_tokens < 0:
        raise UsageError("--max-stored-tokens must be at least 0")
    if not (math.isfinite(shutdown_grace) and 0 <= shutdown_grace <= MAX_SHUTDOWN_GRACE_S):
        raise UsageError(f"--shutdown-grace must be between 0 and {MAX_SHUTDOWN_GRACE_S} seconds, not {shutdown_grace}")
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    if key is not None and not key.strip():
        raise UsageError("--api-key must not be empty")
    key = key.strip() if key is not None else None  # a client's token is read stripped: a key with spaces never matched
    bound = parse_budget(max_archive_size, "--max-archive-size") if max_archive_size is not None else None
    from kvblend.serve.server import ServeOptions, run_server

    run_server(
        ServeOptions(
            host,
            port,
            archive,
            model,
            compute,
            compute_dtype(dtype, archive, model, compute),
            max_queue,
            max_batch,
            key,
            bound,
            max_stored_tokens,
            decode_settings(weights, archive, model, compute, enforce_eager),
            shutdown_grace,
        )
    )
