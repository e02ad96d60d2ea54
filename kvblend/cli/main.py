"""`kvblend` command line: the app, its sub-commands, and one error path for all of them.

Every user-caused failure is a KvblendError: printed as one line on stderr with
a non-zero exit. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import typer

from kvblend.cli import archive_cmds, bench_cmds, controller_cmds, query_cmds
from kvblend.errors import KvblendError

app = typer.Typer(
    name="kvblend",
    help="CacheBlend for RAG: archive every chunk's KV on disk, reuse it in any order, recompute only the tokens that matter.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
archive_cmds.register(app)
query_cmds.register(app)

bench_cmds.register(app)
controller_cmds.register(app)


def main() -> None:
    """Console-script entry point."""
    try:
        code = app(standalone_mode=False)  # click returns typer.Exit's code instead of raising here
        if isinstance(code, int) and code:
            sys.exit(code)
    except KvblendError as exc:
        print(f"kvblend: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("kvblend: interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        print("kvblend: aborted", file=sys.stderr)
        sys.exit(1)
    except Exception as exc:  # click usage errors carry their own formatting
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":
    main()
