"""Redis faults with the real default model, as users meet them through the installed `kvblend`: the server
killed mid-ingest (then a rerun resumes), and Redis as an LRU cache evicting under an ingest. (Split from
test_redis.py so that xdist's loadscope can run the two halves on different workers.)"""

from __future__ import annotations

import json
import subprocess
import time

from test_redis import NAMES, docs, query  # noqa: F401 (docs: the module's fixture, built again here)

from redis_support import redis_server
from support import kvblend_script, one_line_error, run_cli


def test_redis_killed_mid_ingest_then_rerun_resumes_and_nothing_is_half_visible(docs, tmp_path):
    """SIGKILL the Redis (with an append-only file, so what it acknowledged survives) while an ingest writes:
    the ingest fails in one line; after a restart the segments there are whole, and a rerun completes it."""
    with redis_server("--appendonly", "yes", "--appendfsync", "always") as server:
        proc = subprocess.Popen([*kvblend_script(), "ingest", str(docs), "--archive", server.url, "--compute", "cpu",
                                 "--batch-tokens", "512"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not int(server.cli("dbsize").strip() or 0) and time.monotonic() < deadline:
            time.sleep(0.05)  # the first layers are landing
        server.kill()
        out, err = proc.communicate(timeout=120)
        lines = [line for line in err.strip().splitlines() if line.strip()]
        assert proc.returncode != 0 and "Traceback" not in err and len(lines) == 1, err
        assert "cannot reach Redis" in lines[0]
        server.start()  # same port, same directory: the append-only file is replayed
        assert run_cli("verify", "--archive", server.url).returncode == 0  # whole segments or none
        run_cli("ingest", docs, "--archive", server.url, "--compute", "cpu", check=True)
        ls = json.loads(run_cli("ls", "--archive", server.url, "--json", check=True).stdout)
        assert sorted(d["name"] for d in ls) == sorted(NAMES) and all(d["missing_segments"] == 0 for d in ls)
        gc = json.loads(run_cli("gc", "--archive", server.url, "--json", check=True).stdout)
        assert run_cli("verify", "--archive", server.url).returncode == 0 and gc["orphans"] is not None


def test_an_lru_cache_evicts_and_query_recomputes_then_stores_again(docs, tmp_path):
    """Redis as a cache (maxmemory + allkeys-lru): evicted layers are misses, the answer still comes, the
    segment is stored again, `verify` names what is missing and `gc --max-size` evicts on Redis too."""
    with redis_server("--maxmemory", "16mb", "--maxmemory-policy", "allkeys-lru") as server:
        run_cli("ingest", docs, "--archive", server.url, "--compute", "cpu", check=True)  # ~28 MB into 16 MB
        verify = run_cli("verify", "--archive", server.url, "--json")
        assert verify.returncode == 1 and json.loads(verify.stdout)["problems"]  # named, not hidden
        answer = query(server.url, "--doc", NAMES[0])
        result = json.loads(answer.stdout) if answer.returncode == 0 else None
        if result is None:  # the document's record itself was evicted: a clear one-line miss, no traceback
            assert "no such segment" in one_line_error(answer) or "no such document" in one_line_error(answer)
        else:
            assert result["answer"]
        stats = json.loads(run_cli("stats", "--archive", server.url, "--json", check=True).stdout)
        assert stats["store"] == "redis" and stats["redis_policy"] == "allkeys-lru"
        assert stats["redis_maxmemory_bytes"] == 16 * 1024 * 1024
        run_cli("verify", "--repair", "--archive", server.url, check=True)
        gc = json.loads(run_cli("gc", "--max-size", "1B", "--archive", server.url, "--json", check=True).stdout)
        assert run_cli("verify", "--archive", server.url).returncode == 0 and isinstance(gc["evicted"], list)
