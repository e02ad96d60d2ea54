"""Which machine measured what: identity for stored profiles, and the one-line description reports carry.

A profile's timings hold only on the machine that measured them, so profiles
record :class:`Machine` and ``tune`` ignores those of other machines. Reports
(`kvblend bench`, the `make bench` scripts) name their machine with
:func:`describe_machine`. Everything is read from /proc and /sys; torch is
imported only to name a GPU.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Machine:
    """What makes timings comparable: same host, same CPU model, same GPU."""

    hostname: str
    cpu: str
    cores: int | None = None
    gpu: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Machine:
        return cls(str(d.get("hostname", "?")), str(d.get("cpu", "?")), d.get("cores"), d.get("gpu"))


def same_machine(a: Machine, b: Machine) -> bool:
    """Timings measured on `a` hold on `b` (the core count alone does not make another machine)."""
    return (a.hostname, a.cpu, a.gpu) == (b.hostname, b.cpu, b.gpu)


# The instruction sets that decide which CPU kernels pay (fp32 vs bf16 linears above all), best first:
# a cloud VM's "AMD EPYC" may be a Zen 2 with AVX2 only or a Zen 4 with AVX-512 and BF16, whose bf16 matmuls run
# ~2x faster than its fp32 ones, so the marketing name alone does not say whose timings hold here.
_ISA_FLAGS = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's marketing name from /proc/cpuinfo (else what `platform` knows), with its vector instruction
    sets in brackets where /proc/cpuinfo lists them: "AMD EPYC (AVX512-BF16, AVX-512, AVX2)"."""
    name, flags = "", set[str]()
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key == "model name" and not name:
                    name = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                if name and flags:
                    break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "cpu"
    isa = [label for flag, label in _ISA_FLAGS if flag in flags]
    return f"{name} ({', '.join(isa)})" if isa else name


# Device nodes a CUDA (NVIDIA), ROCm (AMD) or WSL GPU shows on Linux: torch.cuda sees no device without one.
_GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def _no_gpu_device() -> bool:
    """True when this machine surely has no GPU torch could use: macOS, or Linux without any GPU device node.

    Answering that from /dev spares commands that only read profiles (`profile --show`) importing torch,
    which takes seconds; anywhere else torch is asked, as before.
    """
    if sys.platform == "darwin":
        return True
    return sys.platform.startswith("linux") and not any(os.path.exists(node) for node in _GPU_DEVICE_NODES)


def gpu_name() -> str | None:
    """The first CUDA device's name, or None (no torch, no driver, or a broken CUDA install)."""
    if _no_gpu_device():
        return None
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # a profile just says "no GPU" rather than failing
        pass
    return None


def machine_info() -> Machine:
    """This machine."""
    return Machine(socket.gethostname(), cpu_model(), os.cpu_count(), gpu_name())


def loadavg() -> float | None:
    """The 1-minute load average: other processes on the cores make timings pessimistic."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _memory_gib() -> float | None:
    try:
        return int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        return None


def describe_machine(runner=None) -> str:
    """One line: host, CPU, cores, memory, the compute device (with a runner), torch, load."""
    import torch

    mem = _memory_gib()
    compute = ""
    if runner is not None:
        dev = runner.device
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
        compute = f", compute {dev.type} ({name}, {runner.dtype_name})"
    load = loadavg()
    return (
        f"{socket.gethostname()}: {cpu_model()}, {os.cpu_count()} cores"
        f"{'' if mem is None else f', {mem:.0f} GiB RAM'}{compute}, torch {torch.__version__}"
        f"{'' if load is None else f', load {load:.2f}'}"
    )


def filesystem_of(path: str) -> dict[str, str] | None:
    """The mount (device, mount point, fs type) holding `path`, from /proc/self/mounts."""
    best = None
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and (best is None or len(mnt) >= len(best[1])):
                    best = (parts[0], mnt, parts[2])
    except OSError:
        return None
    return {"device": best[0], "mount": best[1], "fs_type": best[2]} if best else None


def guess_disk_label(path: str) -> str | None:
    """nvme / hdd / ssd for the block device holding `path` (from /sys), or None when unknowable.

    A guess: virtual disks (virtio, cloud volumes) often claim to be rotational.
    """
    try:
        st = os.stat(path)
        node = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve()
        if not node.exists():
            return None
        for d in (node, node.parent):  # a partition's queue/ lives in its parent disk
            rot = d / "queue" / "rotational"
            if rot.is_file():
                if d.name.startswith("nvme"):
                    return "nvme"
                return "hdd" if rot.read_text().strip() == "1" else "ssd"
    except (OSError, ValueError):
        pass
    return None
