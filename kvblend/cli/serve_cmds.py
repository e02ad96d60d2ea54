"""`kvblend serve`: parsing only; the server is kvblend.serve's.

kvblend.serve (FastAPI, uvicorn, torch) is imported inside the command, so
`kvblend --help` and the archive commands never load it.
"""

from __future__ import annotations

from typing import Optional

import typer

from kvblend.cli.common import ArchiveOpt, ComputeOpt, ModelOpt
from kvblend.errors import UsageError

DEFAULT_MAX_QUEUE = 16


def register(app: typer.Typer) -> None:
    app.command()(serve)


def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    max_queue: int = typer.Option(DEFAULT_MAX_QUEUE, "--max-queue",
                                  help="Requests that may wait for the model; one more is answered 429."),
    archive: Optional[str] = ArchiveOpt,
    model: Optional[str] = ModelOpt,
    compute: Optional[str] = ComputeOpt,
) -> None:
    """Serve an OpenAI-compatible chat API (/v1/chat/completions) that reuses archived KV.

    Questions alone are answered from the archive's top-k segments; passages sent in the
    user message (text parts, or blocks split by <<<chunk>>>) reuse their archived KV,
    and a passage not yet archived is computed and stored for the next request.
    Logs go to stderr; SIGTERM or Ctrl-C shut down gracefully.
    """
    if not 1 <= port <= 65535:
        raise UsageError(f"--port must be between 1 and 65535, not {port}")
    if max_queue < 1:
        raise UsageError("--max-queue must be at least 1")
    from kvblend.serve.server import run_server

    run_server(host, port, archive, model, compute, max_queue)
