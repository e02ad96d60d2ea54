"""Starting the server: the engine warm before the first request, uvicorn, logs on stderr.

The model and the archive are opened before uvicorn starts, so a bad --model
or --archive is one error line and an exit, not a server that never becomes
healthy; /health answers only once the model is loaded. uvicorn handles
SIGTERM and Ctrl-C: it stops accepting, lets requests in flight finish (up to
GRACE_S, then cancels them at their next token), and only then does the
worker's model thread finish and the archive close, so no write is cut short.
"""

from __future__ import annotations

import copy
import logging
import logging.config
import socket
from pathlib import Path

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from kvblend.errors import UsageError
from kvblend.pipeline import Engine
from kvblend.serve.app import create_app
from kvblend.serve.metrics import Metrics
from kvblend.serve.worker import ModelWorker

GRACE_S = 10  # seconds requests in flight get to finish after SIGTERM / Ctrl-C
log = logging.getLogger("kvblend.serve")


def log_config() -> dict:
    """uvicorn's logging with its access log moved to stderr (stdout stays free), plus ours."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    config["loggers"]["kvblend"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


def check_port(host: str, port: int) -> None:
    """Fail before the model loads when the address cannot be bound (in use, bad host)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as exc:
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def run_server(host: str, port: int, archive: Path | None, model: str | None, compute: str | None,
               max_queue: int) -> None:
    """Load the model once, then serve until SIGTERM or Ctrl-C."""
    check_port(host, port)
    logging.config.dictConfig(log_config())
    engine = Engine(archive, model, compute)
    try:
        log.info("loading %s; archive %s", engine.model_name, engine.archive_path)
        engine.archive(create=True)  # a fresh archive is fine: client chunks fill it
        engine.warm_up()
        log.info("model loaded in %.1fs on %s", engine.model_load_s, engine.runner.device)
        app = create_app(ModelWorker(engine, max_queue), Metrics(), engine.model_name, engine.archive_path)
        config = uvicorn.Config(app, host=host, port=port, log_config=log_config(), lifespan="on",
                                timeout_graceful_shutdown=GRACE_S)
        uvicorn.Server(config).run()
    finally:
        engine.close()
