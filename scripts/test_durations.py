"""Refresh tests/durations.json, the seconds each test module took, from a pytest JUnit XML report.

    .venv/bin/python -m pytest -q -n auto --dist loadscope --junitxml=/tmp/junit.xml
    python scripts/test_durations.py /tmp/junit.xml

tests/conftest.py hands the longest modules to the xdist workers first (longest-processing-time-first): with
`--dist loadscope` a module is one unit of work, and xdist's own order (most tests first) left the suite's
longest module, the 200-client serve test with one test, to start last while the other worker sat idle.
A module's figure includes the session fixtures it happened to build (the bundled archive, a model conversion);
the order only needs to be roughly right, so refresh it when modules come or grow, not on every change.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "durations.json"


def module_seconds(report: Path) -> dict[str, float]:
    """Seconds per test module (path relative to the repository), setup and teardown included."""
    seconds: Counter[str] = Counter()
    for case in ET.parse(report).iter("testcase"):
        module = case.get("classname", "").split(".")
        while module and module[-1][:1].isupper():  # a test class: its module is what xdist schedules
            module.pop()
        seconds["/".join(module) + ".py"] += float(case.get("time") or 0)
    return {name: round(value, 1) for name, value in seconds.most_common()}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/test_durations.py JUNIT_XML", file=sys.stderr)
        return 2
    OUT.write_text(json.dumps(module_seconds(Path(argv[0])), indent=1) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
