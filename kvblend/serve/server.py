"""Starting the server: the engine warm before the first request, uvicorn, logs on stderr.

The model and the archive are opened before uvicorn starts, so a bad --model
or --archive is one error line and an exit, not a server that never becomes
healthy; /health answers only once the model is loaded. uvicorn handles
SIGTERM and Ctrl-C: it stops accepting, waiting requests get a 503, the one
in flight may finish within GRACE_S (then it stops at its next token and its
stream ends with an error event), and only then does the worker's model thread
finish and the archive close, so no write is cut short.
"""

from __future__ import annotations

import copy
import logging
import logging.config
import socket

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from kvblend.errors import UsageError
from kvblend.pipeline import Engine
from kvblend.serve.app import create_app
from kvblend.serve.metrics import Metrics
from kvblend.serve.worker import ModelWorker

GRACE_S = 10  # seconds the request in flight gets to finish after SIGTERM / Ctrl-C
log = logging.getLogger("kvblend.serve")


class Server(uvicorn.Server):
    """uvicorn's server, telling the worker as soon as shutdown begins: waiting requests are
    refused and the running one is cut after GRACE_S with an error event, so every stream
    ends well-formed before uvicorn's own (later) deadline would drop the connection."""

    def __init__(self, config: uvicorn.Config, worker: ModelWorker):
        super().__init__(config)
        self.worker = worker

    async def shutdown(self, sockets=None) -> None:
        self.worker.begin_shutdown(GRACE_S)
        await super().shutdown(sockets)


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


def run_server(host: str, port: int, archive: str | None, model: str | None, compute: str | None,
               max_queue: int) -> None:
    """Load the model once, then serve until SIGTERM or Ctrl-C."""
    check_port(host, port)
    logging.config.dictConfig(log_config())
    engine = Engine(archive, model, compute)
    try:
        log.info("loading %s; archive %s", engine.model_name, engine.location)
        engine.archive(create=True)  # a fresh archive is fine: client chunks fill it
        engine.warm_up()
        log.info("model loaded in %.1fs on %s", engine.model_load_s, engine.runner.device)
        worker = ModelWorker(engine, max_queue)
        app = create_app(worker, Metrics(), engine.model_name, engine.location)
        config = uvicorn.Config(app, host=host, port=port, log_config=log_config(), lifespan="on",
                                timeout_graceful_shutdown=2 * GRACE_S)
        Server(config, worker).run()
    finally:
        engine.close()
