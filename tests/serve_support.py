"""`kvblend serve` as tests run it: the installed script in a subprocess on a free loopback port, the real
default model, and the official `openai` client (or raw HTTP for what a client library would refuse to send).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai

from support import kvblend_script

TOKENS = 4
PASSAGES = ["The Skua-7 survey drone is assembled in Halifax by Norrow Marine.",
            "Norrow Marine sells its drones through an office in Aberdeen."]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A `kvblend serve` subprocess; its log goes to a file (a full pipe would stall it)."""

    def __init__(self, archive: Path | str, log: Path, max_queue: int = 8, *args: str,
                 env: dict[str, str] | None = None):
        self.archive, self.log, self.port = archive, log, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
        with open(log, "w") as err:
            self.proc = subprocess.Popen(
                [*kvblend_script(), "serve", "--port", str(self.port), "--archive", str(archive),
                 "--compute", "cpu", "--max-queue", str(max_queue), *args],
                stdout=subprocess.DEVNULL, stderr=err, env=full_env)
        self.wait_healthy()

    def wait_healthy(self, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if get(self.url + "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"server not healthy after {timeout}s:\n{self.log.read_text()}")

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=300)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, resp.read().decode()


def post_raw(url: str, data: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def ask(client: openai.OpenAI, passages: list[str], question: str, **kw):
    parts = [{"type": "text", "text": t} for t in [*passages, question]]
    return client.chat.completions.create(model="kvblend", messages=[{"role": "user", "content": parts}],
                                          max_tokens=kw.pop("max_tokens", TOKENS), **kw)


def report(response) -> dict:
    return response.model_extra["kvblend"]
