"""Where an archive lives: a local directory, or a Redis server or cluster named by a URL.

``--archive`` (and ``$KVBLEND_ARCHIVE``) take either. A URL is
``redis://[user[:password]@]host:port[/db]`` (``rediss://`` for TLS), parsed and
checked here so a malformed one is one line before any connection is tried.
A password never leaves this module in anything shown: :attr:`Location.display`
(what messages, `path`, `stats` and ``--json`` print) and :attr:`Location.key`
(what tuned settings are filed under) both leave it out.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from kvblend.errors import UsageError

REDIS_SCHEMES = ("redis", "rediss")
DEFAULT_REDIS_PORT = 6379


@dataclass(frozen=True)
class RedisAddress:
    """A parsed Redis URL: where to connect and as whom."""

    host: str
    port: int
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False

    @property
    def display(self) -> str:
        """The URL with any password replaced by ``***``."""
        scheme = "rediss" if self.tls else "redis"
        who = ""
        if self.username or self.password:
            who = (self.username or "") + (":***" if self.password else "") + "@"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{who}{host}:{self.port}/{self.db}"


@dataclass(frozen=True)
class Location:
    """An archive's place: exactly one of a directory ``path`` or a Redis ``redis`` address."""

    path: Path | None = None
    redis: RedisAddress | None = None

    @property
    def is_redis(self) -> bool:
        return self.redis is not None

    @property
    def display(self) -> str:
        """What users are shown: the directory, or the URL without its password."""
        return self.redis.display if self.redis is not None else str(self.path)

    @property
    def key(self) -> str:
        """A stable name of the place (tuned settings are filed under it): the directory's real path, or the
        password-free URL."""
        if self.redis is not None:
            return self.redis.display
        return os.path.realpath(os.path.expanduser(os.fspath(self.path or "")))

    def __str__(self) -> str:
        return self.display


_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def is_redis_url(value: str | os.PathLike[str]) -> bool:
    return isinstance(value, str) and value.split("://", 1)[0].lower() in REDIS_SCHEMES and "://" in value


def parse_redis_url(url: str) -> RedisAddress:
    """A Redis URL's parts, as redis-py reads them (``redis.connection.parse_url``: host, port, credentials,
    database); a malformed URL is one UsageError line that does not repeat its password. What redis-py would
    pass over silently is refused here: a missing host, a database that is not a number, a query or fragment
    (redis-py would take connection options from a query)."""
    from redis.connection import parse_url

    bad = UsageError(f"--archive {_shown(url)}: not a Redis URL (redis://[user[:password]@]host:port[/db])")
    scheme, _, rest = url.partition("://")
    normalized = f"{scheme.lower()}://{rest}"  # redis-py knows its schemes in lower case only
    try:
        parts = parse_url(normalized)
        split = urlsplit(normalized)
    except ValueError:
        raise bad from None
    if scheme.lower() not in REDIS_SCHEMES or not parts.get("host"):
        raise bad
    if "@" in split.path:  # a '/' in the password ended the URL's host part there: the rest would be shown
        raise UsageError(f"--archive {_shown(url)}: not a Redis URL (a '/' in a user name or password is written %2F)")
    if split.query or split.fragment:
        raise UsageError(f"--archive {_shown(url)}: a Redis URL takes no query or fragment")
    db_text = split.path.strip("/") or "0"
    # redis-py reads "/-1" or "/3/4" as a number, or ignores "/x" and "/²" (a digit to str.isdigit, not to int)
    if not (db_text.isascii() and db_text.isdigit()):
        raise UsageError(
            f"--archive {_shown(url)}: the database must be a number (redis://host:port/0), not {db_text!r}"
        )
    if split.port == 0:  # redis-py would connect to 6379 instead
        raise UsageError(f"--archive {_shown(url)}: port 0 is no Redis port")
    return RedisAddress(
        host=parts["host"],
        port=parts.get("port") or DEFAULT_REDIS_PORT,
        db=int(parts.get("db", 0)),
        username=parts.get("username"),
        password=parts.get("password"),
        tls=scheme.lower() == "rediss",
    )


def _shown(url: str) -> str:
    """A URL as it may appear in an error: without whatever stands between '://' and '@'."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest:
        rest = "***@" + rest.rsplit("@", 1)[1]
    return f"{scheme}{sep}{rest}"


def resolve_location(value: str | os.PathLike[str] | Location | None) -> Location:
    """Where the archive is: ``--archive``, else ``$KVBLEND_ARCHIVE``, else the XDG cache directory."""
    if isinstance(value, Location):
        return value
    if value is not None and not os.fspath(value).strip():  # `--archive "$UNSET"` must not mean the default
        raise UsageError("--archive is empty (an unset shell variable?)")
    chosen = value or os.environ.get("KVBLEND_ARCHIVE")
    if chosen:
        if is_redis_url(os.fspath(chosen)):
            return Location(redis=parse_redis_url(os.fspath(chosen)))
        if isinstance(chosen, str) and (scheme := _URL_SCHEME.match(chosen)):
            # "reddis://host/0" made a local archive in a folder of that name
            raise UsageError(
                f"--archive {_shown(chosen)}: unsupported scheme {scheme.group(1)!r}; an archive is a directory or "
                "a redis:// or rediss:// URL (Unix sockets are not supported)"
            )
        return Location(path=Path(chosen).expanduser())
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return Location(path=base / "kvblend")
