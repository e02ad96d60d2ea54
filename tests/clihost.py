"""A fork server for the `kvblend` calls a test requires to succeed.

Each `kvblend` process pays ~2.3 s of CPU importing torch and kvblend's model layers before it does anything (0.4 s
for the archive commands), and the suite starts ~470 of them: on 2 cores that was a quarter of `make test`. This
host imports those modules once per test worker, then forks one child per call. The child is a separate process
that runs exactly what the console script runs: `sys.exit(main())` from `kvblend.cli.main`, with the call's argv,
environment, working directory and stdin, its stdout and stderr captured, and the interpreter's shutdown as a
program sees it (non-daemon threads joined, atexit handlers, flushes), so its exit status is the one a user's
shell would see.

What differs from the installed script is only what the fork saves: the imports and interpreter start. So
`support.run_cli` sends here only the calls a test requires to succeed (`check=True`) with the environment
unchanged; a call whose exit status or error line the test examines, or that changes the environment (which
a module may read at import), runs the installed script in a fresh interpreter, as a user meets it.

Run as a script it is the host: requests arrive as JSON lines on stdin; for each it writes the child's pid, then
its exit status.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# What the model commands import inside their functions (the CLI module itself stays light): importing them here
# is the saving. Importing starts no thread, so forking afterwards is safe.
PRELOAD = (
    "kvblend.cli.main",
    "torch",
    "kvblend.pipeline",
    "kvblend.model",
    "kvblend.evaluation.harness",
    "kvblend.tuning.tune",
    "kvblend.tuning.profiling",
)


def _serve() -> dict:
    """The host's loop; returns (in the forked child only) the request the child is to run."""
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)  # tests/ is not on the installed script's path: no test module may shadow a library's
    for name in PRELOAD:
        importlib.import_module(name)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while line := sys.stdin.readline():
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return request
        sys.stdout.write(f"pid {pid}\n")
        sys.stdout.flush()
        _, status = os.waitpid(pid, 0)
        sys.stdout.write(f"rc {os.waitstatus_to_exitcode(status)}\n")
        sys.stdout.flush()
    sys.exit(0)


def _become(request: dict) -> None:
    """In the child: take on the call's directory, environment and standard streams."""
    from kvblend.defaults import ENV_DEFAULTS

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in ENV_DEFAULTS.items():  # what importing kvblend.cli.main sets in a fresh interpreter
        os.environ.setdefault(key, value)
    for fd, path, flags in ((0, request["stdin"], os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                            (2, request["stderr"], os.O_WRONLY)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, encoding=sys.stdin.encoding, closefd=False)  # no read-ahead of the host's requests
    sys.argv = ["kvblend", *request["argv"]]


class Host:
    """The client side: one host process per test process, one call at a time."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.pending = b""  # what the host wrote past the last line read
        self.lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         bufsize=0)
            self.pending = b""
            if self._line(120) != "ready":
                raise RuntimeError("the kvblend test host did not start")
        return self.proc

    def _line(self, timeout: float) -> str | None:
        """The host's next line, read from the pipe unbuffered (a buffered reader could hold the next line where
        select() cannot see it); None on timeout, "" when the host has gone."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return ""
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return line.decode().strip()

    def _expect(self, word: str, timeout: float) -> str:
        """The value of the host's next `WORD VALUE` line; TimeoutExpired if none comes in time."""
        line = self._line(timeout)
        if line is None:
            raise subprocess.TimeoutExpired(["kvblend test host"], timeout)
        found, _, value = line.partition(" ")
        if found != word or not value.lstrip("-").isdigit():
            self.proc = None  # a host that answers out of turn, or died, is not used again
            raise RuntimeError(f"the kvblend test host answered {line!r} instead of {word}")
        return value

    def run(self, args: list[str], env: dict[str, str], input: str | None,
            timeout: float) -> subprocess.CompletedProcess | None:
        """Run `kvblend ARGS`; None when the host is busy with another thread's call (run the script then)."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            proc = self._start()
            with tempfile.TemporaryDirectory(prefix="kvblend-call-") as tmp:
                files = {name: Path(tmp) / name for name in ("stdin", "stdout", "stderr")}
                files["stdin"].write_text(input or "")
                for name in ("stdout", "stderr"):
                    files[name].touch()
                request = {"argv": args, "env": env, "cwd": os.getcwd(), **{k: str(v) for k, v in files.items()}}
                assert proc.stdin is not None
                proc.stdin.write((json.dumps(request) + "\n").encode())
                pid = int(self._expect("pid", 60))
                try:
                    status = self._expect("rc", timeout)
                except subprocess.TimeoutExpired:  # as subprocess.run does: kill the call, then raise
                    os.kill(pid, signal.SIGKILL)
                    self._expect("rc", 60)
                    raise subprocess.TimeoutExpired(["kvblend", *args], timeout) from None
                out, err = (files[n].read_text(errors="replace") for n in ("stdout", "stderr"))
            return subprocess.CompletedProcess(["kvblend", *args], int(status), out, err)
        finally:
            self.lock.release()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(30)


def _run_main() -> int:
    """`sys.exit(main())` as the console script runs it, then the interpreter's shutdown as far as a program can
    see it: non-daemon threads joined, atexit handlers run, standard streams flushed. Tearing down torch's
    modules after that (0.9 s of CPU, nothing a user sees) is skipped."""
    import atexit
    import threading
    import traceback

    from kvblend.cli.main import main

    try:
        main()
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:  # as the interpreter does with sys.exit("message")
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # an uncaught exception: its traceback and status 1, as the interpreter gives
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return code


if __name__ == "__main__":
    _become(_serve())
    os._exit(_run_main())
