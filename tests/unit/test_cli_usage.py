"""Usage errors, as a user meets them: the installed script, one line on stderr, exit 2, no traceback.

No command here gets far enough to load a model (no real weights), so they are unit tests.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from hardening_helpers import build_archive
from support import kvblend_script, one_line_error, run_cli

# Every command, with its required arguments filled, so an unknown option is the only fault.
COMMANDS = {
    "ingest": ["docs/"],
    "query": ["q?"],
    "demo": [],
    "ls": [],
    "show": ["abc"],
    "stats": [],
    "rm": ["a.md"],
    "verify": [],
    "gc": [],
    "path": [],
    "profile": [],
    "tune": [],
    "bench": ["data.json"],
    "serve": [],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_unknown_option_is_one_line_and_exit_2(command, tmp_path):
    proc = run_cli(command, *COMMANDS[command], "--bogus", "--archive", tmp_path / "a")
    line = one_line_error(proc)
    assert proc.returncode == 2
    assert "--bogus" in line and line.startswith("kvblend: error:")
    assert not (tmp_path / "a").exists()  # nothing was created on the way to the error


@pytest.mark.parametrize("command", ["query", "show", "rm", "ingest", "bench"])
def test_missing_argument_is_one_line_and_exit_2(command):
    proc = run_cli(command)
    line = one_line_error(proc)
    assert proc.returncode == 2 and "Missing argument" in line


@pytest.mark.parametrize("args", [["query", "x", "--top-k", "abc"], ["query", "x", "--ratio", "lots"],
                                  ["ingest", "d", "--chunk-tokens", "1.5"], ["bench", "d.json", "--limit", "x"]])
def test_bad_type_is_one_line_and_exit_2(args):
    proc = run_cli(*args)
    line = one_line_error(proc)
    assert proc.returncode == 2 and "Invalid value" in line


@pytest.mark.parametrize("command", ["ingest", "query", "bench", "serve"])
def test_dtype_is_a_choice_checked_before_anything_loads(command, tmp_path):
    proc = run_cli(command, *COMMANDS[command], "--dtype", "fp64", "--archive", tmp_path / "a")
    line = one_line_error(proc)
    assert proc.returncode == 2 and "--dtype" in line and "fp64" in line
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("command", ["query", "bench", "serve"])
def test_weights_is_a_choice_checked_before_anything_loads(command, tmp_path):
    proc = run_cli(command, *COMMANDS[command], "--weights", "int5", "--archive", tmp_path / "a")
    line = one_line_error(proc)
    assert proc.returncode == 2 and "--weights" in line and "int5" in line and "int4" in line
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("level", ["0", "23", "-8"])
def test_ingest_refuses_a_level_zstd_does_not_offer(level, tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("text")
    line = one_line_error(run_cli("ingest", tmp_path / "d", "--archive", tmp_path / "a", "--level", level))
    assert "--level must be between 1 and 22, or -7 and -1" in line
    assert not (tmp_path / "a").exists()


def test_unknown_command_is_one_line_and_exit_2():
    proc = run_cli("frobnicate")
    assert proc.returncode == 2 and "frobnicate" in one_line_error(proc)


def test_help_works_for_every_command():
    top = run_cli("--help", check=True)
    for command in COMMANDS:
        assert command in top.stdout
        assert run_cli(command, "--help", check=True).stdout.strip()


def test_usage_errors_come_before_torch_imports(tmp_path):
    """A mistyped flag, path, document or segment is told in a fraction of a second: ingest and query check
    them (and the archive) before importing torch, here a torch that refuses to import, let alone a model."""
    poisoned = tmp_path / "poisoned"
    (poisoned / "torch").mkdir(parents=True)
    (poisoned / "torch" / "__init__.py").write_text('raise ImportError("torch was imported")\n')
    arc = build_archive(tmp_path / "arc", n=2)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("text")
    invisible = tmp_path / "invisible.txt"
    invisible.write_text("\u200b\x1b[31m\x1b[0m\n")  # zero-width and colour codes alone
    cases = [
        (("ingest", tmp_path / "missing", "--archive", arc), "no such file"),
        (("ingest", tmp_path / "docs", "--archive", arc, "--batch-tokens", "0"), "--batch-tokens"),
        (("query", "q?", "--archive", arc, "--top-k", "0"), "--top-k"),
        (("query", "q?", "--archive", arc, "--temperature", "-1"), "--temperature"),
        (("query", "q?", "--archive", tmp_path / "nowhere"), "no archive"),
        (("query", "  ", "--archive", arc), "empty question"),  # was told only after the model loaded
        (("query", "\u200b\u200b", "--archive", arc), "empty question"),  # nothing that shows: ingest's `empty`
        (("query", "q?", "--archive", arc, "--context-file", invisible), "context file is empty"),
        (("query", "q?", "--archive", arc, "--max-tokens", "0"), "--max-tokens must be at least 1"),
        (("query", "q?", "--archive", ""), "--archive is empty"),  # fell back to the default archive
        (("query", "q?", "--archive", arc, "--doc", "nope.md"), "no such document"),
        (("query", "q?", "--archive", arc, "--segment", "feedface"), "no such segment"),
        (("tune", "--archive", arc, "--limit", "0"), "--limit"),
        (("tune", "--archive", tmp_path / "nowhere"), "no archive"),
        (("serve", "--archive", arc, "--shutdown-grace", "-1"), "--shutdown-grace"),
        (("serve", "--archive", arc, "--shutdown-grace", "1e12"), "--shutdown-grace"),  # overflowed its timer
        (("serve", "--archive", arc, "--max-batch", "100000000000000000000"), "--max-batch must be between 1 and"),
    ]
    for args, expected in cases:
        line = one_line_error(run_cli(*args, env={"PYTHONPATH": str(poisoned)}))
        assert expected in line and "torch" not in line, (args, line)


def test_profile_device_redis_on_a_local_archive_is_refused_before_the_model_loads(tmp_path):
    """It passed the label check, loaded the model, then named nvme, ssd, hdd and ram as the choices."""
    proc = run_cli("profile", "--archive", tmp_path / "a", "--device", "redis", "--model", tmp_path / "no.gguf")
    line = one_line_error(proc)
    assert proc.returncode == 2 and "--device redis measures an archive on Redis" in line, line


def test_the_test_host_runs_a_call_as_the_installed_script_does(tmp_path):
    """support.run_cli sends calls that must succeed to clihost's forked children: the same `main()`, so the same
    stdout, stderr and exit status as the installed script, for a success, a failure, stdin and the cwd."""
    from support import _host

    arc = build_archive(tmp_path / "arc", n=3)
    (tmp_path / "docs").mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    host = _host()
    for args, stdin in ((["ls", "--archive", str(arc), "--json"], None), (["stats", "--archive", str(arc)], None),
                        (["rm", "/docs/a.md", "--archive", str(tmp_path / "none")], None),
                        (["ingest", "docs", "--archive", str(tmp_path / "new")], None),
                        (["rm", "/docs/missing.md", "--archive", str(arc)], "y\n")):
        cwd = os.getcwd()
        os.chdir(tmp_path)  # "docs" is relative: the call runs where the test stands
        try:
            hosted = host.run(args, env, stdin, timeout=120)
            script = run_cli(*args, input=stdin)
        finally:
            os.chdir(cwd)
        assert hosted is not None
        assert (hosted.returncode, hosted.stdout, hosted.stderr) == \
            (script.returncode, script.stdout, script.stderr), args


def test_ingest_of_an_empty_path_is_refused_not_read_as_the_current_directory(tmp_path):
    """`kvblend ingest "$DOCS"` with DOCS unset: Path("") is ".", so it archived whatever folder it ran in."""
    (tmp_path / "a.txt").write_text("A document in the folder the command runs in.")
    proc = subprocess.run([*kvblend_script(), "ingest", "", "--archive", str(tmp_path / "arc")], cwd=tmp_path,
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert proc.returncode == 2 and "an empty path names no file or directory" in one_line_error(proc)
    assert not (tmp_path / "arc").exists()


@pytest.mark.parametrize("where", ["file", "under-a-file"])
def test_a_dry_run_refuses_an_archive_the_ingest_could_not_create(tmp_path, where):
    """It wrote nothing and promised "would store ...", for an --archive the ingest itself then refused."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("A short document.")
    (tmp_path / "afile").write_text("not an archive")
    archive = tmp_path / "afile" if where == "file" else tmp_path / "afile" / "sub"
    line = one_line_error(run_cli("ingest", tmp_path / "d", "--dry-run", "--archive", archive))
    assert "is a file, not a directory" in line
    assert (tmp_path / "afile").read_text() == "not an archive"


def test_a_file_name_with_a_newline_keeps_the_error_on_one_line(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "bad\nname.txt").write_bytes(b"\x00\x01 binary")
    line = one_line_error(run_cli("ingest", tmp_path / "d", "--archive", tmp_path / "arc"))
    assert line.endswith("bad\\nname.txt (binary)")


@pytest.mark.parametrize("given,options,warned", [
    ({"ratio", "select"}, {"mode": "prefix"}, "--ratio, --select have no effect with --mode prefix"),
    ({"top_k"}, {"docs": ("a.md",)}, "--top-k has no effect with --doc or --segment"),
    (set(), {"store_context": True}, "--store has no effect without --context-file"),
    ({"seed"}, {}, "--seed has no effect at --temperature 0"),
    ({"deviation"}, {}, "--deviation has no effect with --select probe"),
])
def test_options_a_query_leaves_without_effect_are_named(given, options, warned):
    """`--mode prefix --ratio 0.5` ran as if no ratio was given, and said nothing."""
    from types import SimpleNamespace

    from kvblend.cli.query_cmds import _ignored_options
    from kvblend.pipeline import QueryOptions

    source = {True: SimpleNamespace(name="COMMANDLINE"), False: SimpleNamespace(name="DEFAULT")}
    ctx = SimpleNamespace(get_parameter_source=lambda name: source[name in given])
    assert [n for n in _ignored_options(ctx, QueryOptions(**options)) if n.startswith(warned)]
    defaults = SimpleNamespace(get_parameter_source=lambda name: source[False])
    assert _ignored_options(defaults, QueryOptions()) == []  # nothing given: nothing said
