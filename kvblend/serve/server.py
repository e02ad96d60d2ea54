"""Starting the server: the engine warm before the first request, uvicorn, logs on stderr.

The model and the archive are opened before uvicorn starts, so a bad --model
or --archive is one error line and an exit, not a server that never becomes
healthy; /health answers only once the model is loaded. uvicorn handles
SIGTERM and Ctrl-C: it stops accepting, waiting requests get a 503, those
in flight may finish within the grace period (--shutdown-grace; then they
stop at their next step and their streams end with an error event), and
only then does the scheduler's model thread finish and the archive close,
so no write is cut short.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import logging.config
import math
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from kvblend.defaults import DEFAULT_SHUTDOWN_GRACE_S
from kvblend.errors import UsageError
from kvblend.pipeline import Engine
from kvblend.pipeline.query import Prepared
from kvblend.serve.app import create_app
from kvblend.serve.engine_core import EngineCore
from kvblend.serve.metrics import Metrics
from kvblend.types import Steps

log = logging.getLogger("kvblend.serve")


class Server(uvicorn.Server):
    """uvicorn's server, telling the scheduler as soon as shutdown begins: waiting requests are
    refused and running ones are cut after the grace period with an error event, so every stream ends
    well-formed before uvicorn's own (later) deadline would drop the connection."""

    def __init__(self, config: uvicorn.Config, scheduler: EngineCore, grace_s: float = DEFAULT_SHUTDOWN_GRACE_S):
        super().__init__(config)
        self.scheduler = scheduler
        self.grace_s = grace_s

    async def shutdown(self, sockets=None) -> None:
        self.scheduler.begin_shutdown(self.grace_s)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn raises the signal it caught again once it has shut down gracefully: SIGTERM then killed the
        process (exit 143) before `engine.close()` drained the writes queued after the answers, and Ctrl-C
        ended as "interrupted" (130). A graceful stop is a normal exit (0), with the archive closed."""
        with super().capture_signals():
            yield
            self._captured_signals.clear()


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


def archive_bound(engine: Engine, max_bytes: int) -> Callable[[Prepared], Steps[None]]:
    """After a request that stored something: evict least-recently-used segments until the archive's payloads
    fit `max_bytes` again (`gc --max-size` while serving), so no client can fill the disk or the Redis."""

    def after(prepared: Prepared) -> Steps[None]:
        yield None
        if not any(info.stored for info in prepared.infos) and not prepared.unreadable:
            return
        archive = engine.archive()
        if archive.size_bytes(include_index=False) > max_bytes:
            report = archive.gc(max_size_bytes=max_bytes)
            log.info(
                "archive over --max-archive-size: evicted %d segments (%d bytes)",
                len(report.evicted),
                report.freed_bytes,
            )

    return after


def in_a_thread_of_its_own(work: Callable[[], None]) -> None:
    """Run `work` on a thread that ends with it, raising its exception here: how the server loads its model.

    torch's CPU ops run in OpenMP parallel regions, and libgomp keeps a pool of worker threads for every thread
    that has started one, until that thread ends. Once the pools' threads outnumber the cores, libgomp stops
    spinning between regions, so every region waits for its workers to be woken. Loaded on the main thread,
    the model left it a pool beside the model thread's: on the 2-core AMD EPYC a 200k-float torch.add took
    52-82 µs on the model thread against 17-20 µs on the first thread to use OpenMP, and an int4 decode step
    40 ms against 23 ms. Loaded here, no pool outlives the load, the main thread (the event loop) never starts
    one, and the model thread's regions run at full speed."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # handed to the caller, which reports it as the CLI does
            failure.append(exc)

    # a daemon, waited on in steps: Ctrl-C during a load stops the server at once instead of after the load
    thread = threading.Thread(target=run, name="kvblend-load", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
    if failure:
        raise failure[0]


def run_server(options: ServeOptions) -> None:
    """Load the model once, then serve until SIGTERM or Ctrl-C."""
    check_port(options.host, options.port)
    logging.config.dictConfig(log_config())
    engine = Engine(options.archive, options.model, options.compute, options.dtype, **options.weights)
    try:
        log.info("loading %s; archive %s", engine.model_name, engine.location)
        archive = engine.archive(create=True)  # a fresh archive is fine: client chunks fill it
        in_a_thread_of_its_own(engine.warm_up)
        log.info(
            "model loaded in %.1fs on %s (%s, %s weights in decode%s); batches of up to %d sequences",
            engine.model_load_s,
            engine.runner.device,
            engine.runner.dtype_name,
            engine.runner.weights_name,
            ", CUDA graphs" if engine.runner.device.type == "cuda" and engine.runner.cuda_graphs else "",
            options.max_batch,
        )
        if options.host not in ("127.0.0.1", "localhost", "::1") and not options.api_key:
            log.warning(
                "listening on %s without --api-key: anyone who can reach port %d can use this server",
                options.host,
                options.port,
            )
        bound = archive_bound(engine, options.max_archive_bytes) if options.max_archive_bytes else None
        scheduler = EngineCore(
            engine,
            options.max_queue,
            options.max_batch,
            after_request=bound,
            max_stored_tokens=options.max_stored_tokens,
        )
        where = engine.location  # a local archive's directory as given and as its real path (Location.key)
        hidden = (str(where.path), where.key) if where.path is not None else ()
        app = create_app(scheduler, Metrics(), engine.model_name, archive.store.kind, options.api_key, hidden)
        config = uvicorn.Config(
            app,
            host=options.host,
            port=options.port,
            log_config=log_config(),
            lifespan="on",
            # uvicorn's own deadline, 10 s past the grace: time for the cut streams' error events to go out
            timeout_graceful_shutdown=math.ceil(options.shutdown_grace_s) + 10,
        )
        Server(config, scheduler, options.shutdown_grace_s).run()
    finally:
        engine.close()


@dataclass(frozen=True)
class ServeOptions:
    """`kvblend serve`'s options, parsed."""

    host: str
    port: int
    archive: str | None
    model: str | None
    compute: str | None
    dtype: str | None
    max_queue: int
    max_batch: int
    api_key: str | None
    max_archive_bytes: int | None
    max_stored_tokens: int | None
    weights: dict = field(default_factory=dict)  # Engine keywords: the format, its decode rows, CUDA graphs or not
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
