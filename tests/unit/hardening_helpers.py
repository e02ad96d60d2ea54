"""What the hardening tests share: a small archive with documents, file snapshots, another user, a tmpfs.

The archive is built through the API with tiny random KV (no model), so the
CLI can then be run against it in a subprocess, as a user would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from lmdb import verify as lmdb_verify

from archive_helpers import TOKENS, layers
from kvblend.archive import Archive, DocumentRecord, SegmentRecord
from kvblend.archive.indexcheck import _Walker
from support import REPO, kvblend_script

N_SEGMENTS = 6
DOCS = {"/docs/a.md": ["seg00", "seg01", "seg02"], "/docs/b.md": ["seg02", "seg03", "seg04"]}  # seg05: no document
NOBODY = 65534


def embedding(i: int) -> np.ndarray:
    return np.arange(8, dtype=np.float32) + i


def build_archive(path: Path, n: int = N_SEGMENTS, n_layers: int = 4) -> Path:
    """An archive of ``n`` segments ``seg00``.. with embeddings, and the two documents of DOCS."""
    items = [(SegmentRecord(key=f"seg{i:02d}", token_ids=list(range(i, i + TOKENS)), text=f"text of segment {i}",
                            extra={"sink": "alone"}), layers(i, n_layers=n_layers)) for i in range(n)]
    with Archive.open(path, model_name="tiny", model_fingerprint="fp-tiny") as ar, ar.writer():
        ar.put_segments(items, embeddings={rec.key: embedding(i) for i, (rec, _) in enumerate(items)})
        for doc, keys in DOCS.items():
            ar.replace_document(DocumentRecord(path=doc, content_hash=f"hash {doc}", segment_keys=keys,
                                               n_tokens=TOKENS * len(keys), size=100))
    return path


def index_pages(data: Path) -> tuple[list[int], list[int]]:
    """The branch and leaf pages the newest snapshot of an LMDB data file reads, and the first page of each overflow
    run: the pages LMDB follows pointers through (stale copies LMDB left behind are read by nothing).

    From the index check's walk (lmdb.verify's reachable pages), each sorted by the type its own header gives.
    """
    with open(data, "rb") as f:
        walker = _Walker(f, os.fstat(f.fileno()).st_size, collect=False)
        walker.verify()
        tree, heads = [], []
        for page in (p for p in range(len(walker.live)) if walker.live[p]):
            header = walker.read_page(page)
            if walker._pg_pgno(header, 0) != page:
                continue  # the body of an overflow run
            flags = walker._pg_flags(header, 0)
            (heads if flags & lmdb_verify.P_OVERFLOW else tree).append(page)
    return tree, heads


def snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``root`` with its mode and bytes, except LMDB's reader table ``lock.mdb``.

    ``lock.mdb`` is LMDB's shared lock file: a reader registers in it to read
    safely beside a writer, which is not a change to the archive.
    """
    return {str(p.relative_to(root)): (p.stat().st_mode, p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "lock.mdb"}


def tree(root: Path) -> list[str]:
    """Every path under ``root`` (directories too), to show nothing was created."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@dataclass
class OtherUser:
    """How to run kvblend as a user who cannot write the archive: ``prefix`` switches user (empty when the
    tests already run unprivileged), ``command`` starts kvblend as that user reaches it, ``env`` adds what it needs.
    """

    prefix: list[str]
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Any program as this user (e.g. the interpreter with ``-c``)."""
        return subprocess.run([*self.prefix, *argv], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env})

    @property
    def python(self) -> str:
        """An interpreter this user can start, with kvblend importable (given ``env``)."""
        return self.command[0] if self.command[1:2] == ["-m"] else sys.executable


def _can_import_kvblend(prefix: list[str], python: str, env: dict[str, str]) -> bool:
    probe = subprocess.run([*prefix, python, "-c", "import kvblend.cli.main"], capture_output=True, text=True,
                           timeout=120, env={**os.environ, **env})
    return probe.returncode == 0


@contextmanager
def _checkout_for(prefix: list[str]) -> Iterator[OtherUser]:
    """kvblend as the user of ``prefix`` can start it.

    A checkout in a private directory (``mktemp -d`` makes 0700 ones, as many homes are) cannot be
    read by another user: its venv is unreachable. Then the checkout is bind-mounted read-only into a
    public temp directory for the test and kvblend runs from there (``python -m``, with the mount on
    PYTHONPATH, since the editable install points at the private path); where that is not allowed
    either, the test is skipped with the reason.
    """
    if _can_import_kvblend(prefix, sys.executable, {}):
        yield OtherUser(prefix, kvblend_script())
        return
    with public_dir() as base:
        mount = base / "checkout"
        mount.mkdir()
        proc = subprocess.run(["mount", "--bind", "-o", "ro", str(REPO), str(mount)], capture_output=True,
                              text=True, timeout=30)
        if proc.returncode != 0:
            pytest.skip(f"the checkout {REPO} is private to its owner and cannot be bind-mounted where user "
                        f"{NOBODY} can read it ({proc.stderr.strip() or proc.returncode})")
        try:
            here = Path(sys.executable)
            python = str(mount / here.relative_to(REPO)) if here.is_relative_to(REPO) else str(here)
            env = {"PYTHONPATH": str(mount)}
            if not _can_import_kvblend(prefix, python, env):
                pytest.skip(f"user {NOBODY} cannot start {sys.executable} even through a public bind mount of "
                            "the checkout")
            yield OtherUser(prefix, [python, "-m", "kvblend.cli.main"], env)
        finally:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


@contextmanager
def readonly_tree(root: Path) -> Iterator[OtherUser]:
    """Make ``root`` unwritable for the user the CLI will run as; yields how to run kvblend as that user.

    Tests run as root here, and root ignores permissions, so the CLI runs as
    ``nobody`` (setpriv) on a tree it does not own. As another user, the tree
    is chmod-ed read-only instead.
    """
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: cannot run the CLI as a user without write access")
        for p in [root, *root.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        for up in root.parents:
            if up.stat().st_mode & 0o001 == 0:
                pytest.skip(f"{up} is not searchable by other users")
        with _checkout_for(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]) as user:
            yield user
        return
    modes = {p: p.stat().st_mode for p in [root, *root.rglob("*")]}
    for p in modes:
        p.chmod(modes[p] & ~0o222)
    try:
        yield OtherUser([], kvblend_script())
    finally:
        for p, mode in modes.items():
            p.chmod(mode)


def run_as(user: OtherUser, *args, timeout: float = 120, home: Path | None = None) -> subprocess.CompletedProcess:
    """`kvblend ARGS` as ``user`` runs it; like support.run_cli, which cannot switch users.

    ``home``: that user's home (its model cache goes there); default none at all.
    """
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HOME": str(home or "/nonexistent"),
           **user.env}
    env.pop("XDG_CACHE_HOME", None)
    env.pop("KVBLEND_MODEL_CACHE", None)
    return subprocess.run([*user.prefix, *user.command, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def home_for(user: OtherUser, base: Path) -> Path:
    """A home directory the user owns (for its own caches), under ``base``."""
    home = base / "home"
    home.mkdir(exist_ok=True)
    if user.prefix:
        os.chown(home, NOBODY, NOBODY)
    return home


def seed_model_cache(user: OtherUser, home: Path, runner) -> None:
    """Give ``user``'s ``home`` its own copy of the checkpoint the tests' model cache converted for ``runner``.

    The user then loads the model as on any run after its first, instead of spending ~20 s of the suite
    de-quantising the GGUF again into a fresh home (conversion is tested on its own: test_conversion)."""
    from kvblend.model.loading import cached_conversion

    source = cached_conversion(runner.name, runner.fingerprint)
    assert source is not None, f"no converted checkpoint of {runner.name}"
    cache = home / ".cache" / "kvblend-models"
    shutil.copytree(source, cache / source.name)
    if user.prefix:
        for path in [home / ".cache", *(home / ".cache").rglob("*")]:
            os.chown(path, NOBODY, NOBODY)


@contextmanager
def public_dir():
    """A fresh directory under /tmp that other users can reach (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="kvblend-test-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def small_tmpfs(mountpoint: Path, size: str = "6m"):
    """A tmpfs of ``size`` at ``mountpoint`` (a disk that really fills up); skips where mounting is not allowed."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mountpoint)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount a tmpfs here ({e})")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode}); needs root")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, timeout=30)


def fill_disk(directory: Path, name: str = "filler") -> Path:
    """Write zeros into ``directory/name`` until the file system is full (ENOSPC)."""
    path = directory / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for size in (1 << 16, 4096, 512, 1):  # big writes, then the last partial blocks
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return path
