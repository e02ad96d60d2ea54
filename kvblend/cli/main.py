"""`kvblend` command line: the app, its sub-commands, and one error path for all of them.

Every failure a user can cause ends as one line on stderr and a non-zero exit:
a KvblendError (bad value, bad archive) exits with its own code, a usage error
(unknown option, missing argument, bad type) with 2. Only a bug keeps its
traceback. Importing this module must stay cheap (no torch): commands import
the heavy layers inside their functions, so `kvblend --help` and `kvblend ls`
answer in well under a second.
"""

from __future__ import annotations

import os
import sys

from kvblend.defaults import ENV_DEFAULTS

os.environ.update({key: os.environ.get(key, value) for key, value in ENV_DEFAULTS.items()})

import typer
from typer.exceptions import TyperException

from kvblend.cli import archive_cmds, bench_cmds, query_cmds, serve_cmds, tuning_cmds
from kvblend.cli.common import printable
from kvblend.errors import KvblendError

app = typer.Typer(
    name="kvblend",
    help="CacheBlend for RAG: archive every chunk's KV on disk, reuse it in any order, recompute only the tokens that matter.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
archive_cmds.register(app)
query_cmds.register(app)
bench_cmds.register(app)
tuning_cmds.register(app)
serve_cmds.register(app)


def usage_line(exc: Exception) -> str:
    """One line for a click/typer usage error: what was wrong and where to look.

    typer ≥ 0.2x vendors click as `typer._click`, so `click.ClickException` does not
    match its errors; `typer.exceptions.TyperException` is the public base of both.
    """
    message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    message = " ".join(message.split())
    ctx = getattr(exc, "ctx", None)
    command = getattr(ctx, "command_path", None) or "kvblend"
    return f"kvblend: error: {message} (see `{command} --help`)"


def _is_usage_error(exc: BaseException) -> bool:
    if isinstance(exc, TyperException):
        return True
    try:  # an older typer raising the real click's exceptions
        import click
    except ImportError:  # pragma: no cover - click is optional with a vendoring typer
        return False
    return isinstance(exc, click.ClickException)


INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    try:
        code = app(args=argv, standalone_mode=False)  # returns typer.Exit's code instead of raising
        if code == INTERRUPTED:  # typer turns a KeyboardInterrupt into Exit(130) before we see it
            print("kvblend: interrupted", file=sys.stderr)
        if isinstance(code, int) and code:
            sys.exit(code)
    except KvblendError as exc:
        print(f"kvblend: error: {printable(str(exc))}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("kvblend: interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        print("kvblend: interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED)
    except Exception as exc:
        if not _is_usage_error(exc):
            raise
        print(printable(usage_line(exc)), file=sys.stderr)
        sys.exit(getattr(exc, "exit_code", 2) or 2)


if __name__ == "__main__":
    main()
