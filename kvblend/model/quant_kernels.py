"""kvblend's CPU kernels for weight-only Q4_1, Q8_0 and Q8_16 decode matmuls (quant_gemv.c), built on first use.

Why a kernel of our own: a decode step reads every weight once, so it runs at the speed of the weights'
bytes only if unpacking them keeps up with memory. torch 2.13's CPU kernels for int4 and int8 weights do
not: on a 2-core AMD EPYC they were 7-11x *slower* than fp32's matmul on a 1,536 x 576 product
(BENCHMARKS.md, issue 34), so 4-bit weights decoded slower than the fp32 weights they de-quantise to.
quant_gemv.c reads GGUF's own Q4_1 and Q8_0 blocks with AVX-512 or AVX2 and accumulates in fp32, so a
GGUF's quantized weights are multiplied as they are in the file (llama.cpp's model, at its bytes).

The library is compiled once per machine and source with the machine's C compiler (`cc`, or $CC) and
`-march=native`, into the model cache (kvblend.model.source.model_cache_dir), and loaded with ctypes; the
OpenMP threads it uses are torch's own runtime's (torch loads libgomp first). Without a compiler, or with
KVBLEND_CPU_KERNELS=0, :func:`kernels` is None and kvblend.model.weights uses torch's kernels instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from kvblend.model.source import model_cache_dir

SOURCE = Path(__file__).with_name("quant_gemv.c")
#: Inputs in whole blocks of this many weights (Q4_1's and Q8_0's block).
BLOCK = 32
#: Q8_16's scales: one per this many input weights (GGUF Q6_K's sub-block).
HALF_BLOCK = 16
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
_LIBS = ("-lm",)
_COMPILE_TIMEOUT_S = 120


class QuantKernels:
    """The loaded library's kernels over CPU tensors: two weight-only products and decode attention."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        ptr, i = ctypes.c_void_p, ctypes.c_int  # tensors go in as their data pointers
        self._q4 = lib.kvb_q4_1_gemv
        self._q4.argtypes = [ptr, i, i, ptr, ptr, ptr, i, ptr, i]
        self._q4.restype = ctypes.c_int
        self._q8 = lib.kvb_q8_0_gemv
        self._q8.argtypes = [ptr, i, i, ptr, ptr, i, ptr, i]
        self._q8.restype = ctypes.c_int
        self._q8_16 = lib.kvb_q8_16_gemv
        self._q8_16.argtypes = [ptr, i, i, ptr, ptr, i, ptr, i]
        self._q8_16.restype = ctypes.c_int
        self._attn = lib.kvb_decode_attention
        self._attn.argtypes = [ptr, ptr, ptr, i, ctypes.c_int64, i, i, i, i, ctypes.c_float, ptr, i]
        self._attn.restype = ctypes.c_int
        self._attn_takes = lib.kvb_attention_takes
        self._attn_takes.argtypes = [i, i, i]
        self._attn_takes.restype = ctypes.c_int
        self._step = lib.kvb_decode_step
        self._step.argtypes = [ptr, ptr, ptr, i, ptr, ptr, ptr, ptr, ptr, ptr, i]
        self._step.restype = ctypes.c_int
        self._step_takes = lib.kvb_step_takes
        self._step_takes.argtypes = [ptr]
        self._step_takes.restype = ctypes.c_int

    def q4_1(self, x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """x [rows, in] @ W.T for W in Q4_1: `codes` [out, in/2] (GGUF's nibble order), `d`, `m` [out, in/32]."""
        return self._product(self._q4, x, codes, torch.uint8, 2, d, m)

    def q8_0(self, x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """x [rows, in] @ W.T for W in Q8_0: `codes` [out, in] int8, `d` [out, in/32]."""
        return self._product(self._q8, x, codes, torch.int8, 1, d)

    def q8_16(self, x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """x [rows, in] @ W.T for W in Q8_16: `codes` [out, in] int8, `d` [out, in/16] (a scale per 16)."""
        return self._product(self._q8_16, x, codes, torch.int8, 1, d, scale_block=HALF_BLOCK)

    def _product(
        self,
        kernel: Callable[..., int],
        x: torch.Tensor,
        codes: torch.Tensor,
        dtype: torch.dtype,
        per_byte: int,
        *scales: torch.Tensor,
        scale_block: int = BLOCK,
    ) -> torch.Tensor:
        """One product: the blocks checked against x's width (`per_byte` codes a byte), then the kernel."""
        x = x.float().contiguous()
        rows, n_in = x.shape
        n_out = codes.shape[0]
        check_blocks(n_in, codes, dtype, n_in // per_byte, *scales, scale_block=scale_block)
        y = torch.empty(rows, n_out, dtype=torch.float32)
        pointers = (t.data_ptr() for t in (codes, *scales))
        if kernel(x.data_ptr(), rows, n_in, *pointers, n_out, y.data_ptr(), _threads()) != 0:
            raise MemoryError("kvblend's quantized product could not allocate its block sums")
        return y

    def attention_fits(self, heads: int, kv_heads: int, head_dim: int) -> bool:
        """Does this build's decode attention take a model of this shape? (The C side's own rule.)"""
        return bool(self._attn_takes(heads, kv_heads, head_dim))

    def decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
        """One query per head over every key of k, v ([1, kv_heads, T, hd] views of a decode buffer, fp32 or
        fp16, rows contiguous): [1, heads, 1, hd], or None where the kernel does not take these shapes."""
        if not _attention_shapes_fit(q, k, v):
            return None
        q = q.contiguous()
        out = torch.empty_like(q)
        status = self._attn(
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            int(k.dtype == torch.float16),
            k.stride(1),
            k.shape[2],
            q.shape[1],
            k.shape[1],
            q.shape[3],
            scale,
            out.data_ptr(),
            _threads(),
        )
        return out if status == 0 else None

    def step_takes(self, shape: ctypes.Structure) -> bool:
        """Does this build's whole decode step take a model of this shape (kvblend.model.fused_step._Shape)?"""
        return bool(self._step_takes(ctypes.addressof(shape)))

    def decode_step(
        self,
        shape: ctypes.Structure,
        layers: ctypes.Array,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[ctypes.Array, ctypes.Array],
        head_strides: ctypes.Array,
        positions: ctypes.Array,
    ) -> None:
        """Every layer of one decode step, in place on `hidden` [rows, dim] fp32 (kvblend.model.fused_step says
        what the arguments hold; it checks them, since the C side reads and writes through raw pointers)."""
        status = self._step(
            ctypes.addressof(shape),
            ctypes.addressof(layers),
            hidden.data_ptr(),
            hidden.shape[0],
            cos.data_ptr(),
            sin.data_ptr(),
            ctypes.addressof(kv[0]),
            ctypes.addressof(kv[1]),
            ctypes.addressof(head_strides),
            ctypes.addressof(positions),
            _threads(),
        )
        if status != 0:
            raise MemoryError("kvblend's decode step could not allocate its buffers")


def check_blocks(
    n_in: int,
    codes: torch.Tensor,
    dtype: torch.dtype,
    row_bytes: int,
    *scales: torch.Tensor,
    scale_block: int = BLOCK,
) -> None:
    """What the C side reads through raw pointers must be what it assumes: a wrong tensor would read out of
    bounds, not raise. `scales` hold one value per `scale_block` input weights (16 for Q8_16)."""
    n_out = codes.shape[0]
    ok = n_in % BLOCK == 0 and codes.dtype == dtype and codes.is_contiguous() and codes.shape == (n_out, row_bytes)
    ok = ok and all(
        t.dtype == torch.float32 and t.is_contiguous() and t.shape == (n_out, n_in // scale_block) for t in scales
    )
    if not ok or codes.device.type != "cpu":
        raise ValueError(f"quantized weight blocks do not match an input of {n_in}: {tuple(codes.shape)} {codes.dtype}")


def _attention_shapes_fit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    one = q.shape[0] == 1 and q.shape[2] == 1 and q.dtype == torch.float32 and q.shape[3] == k.shape[3]
    same = k.dtype == v.dtype and k.dtype in (torch.float32, torch.float16) and k.stride() == v.stride()
    same = same and k.shape == v.shape and v.device.type == "cpu" and k.shape[1] > 0
    return (
        one
        and same
        and k.device.type == "cpu"
        and k.shape[0] == 1
        and k.stride(3) == 1
        and k.stride(2) == k.shape[3]
        and k.shape[2] > 0
    )


def _threads() -> int:
    return max(1, torch.get_num_threads())


@functools.cache
def kernels() -> QuantKernels | None:
    """The kernels for this machine, built the first time (about a second); None where they cannot be, or
    where the build has no vector path (a CPU without AVX-512 or AVX2 with FMA: torch's kernels do better)."""
    if os.environ.get("KVBLEND_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    for path in _built(compiler):
        try:
            lib = ctypes.CDLL(str(path))
            if lib.kvb_simd() != 1:
                return None
            return QuantKernels(lib, path)
        except (OSError, AttributeError):
            continue  # unloadable (another user's file, a damaged one): the next place
    return None


def _built(compiler: str) -> Iterator[Path]:
    """The compiled library for this source, compiler and CPU, from each place that has or can build it:
    the model cache, then a private directory under the system temp directory. A build goes to a temporary
    name and is renamed into place, so processes building at once never load a half-written file."""
    try:
        key = hashlib.sha256()
        key.update(SOURCE.read_bytes())
        key.update(" ".join((compiler, *_FLAGS, platform.machine(), _cpu_flags())).encode())
        key.update(subprocess.run([compiler, "--version"], capture_output=True, timeout=30).stdout)
    except (OSError, subprocess.SubprocessError):
        return
    name = f"quant_gemv-{key.hexdigest()[:16]}.so"
    for directory in (model_cache_dir() / "kernels", Path(tempfile.gettempdir()) / f"kvblend-kernels-{os.getuid()}"):
        target = directory / name
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not _trusted(directory):
                continue
            if target.exists():
                yield target
                continue
            fd, tmp = tempfile.mkstemp(dir=directory, suffix=".so.part")
            os.close(fd)
        except OSError:
            continue  # not writable: the next place
        try:
            subprocess.run(
                [compiler, *_FLAGS, str(SOURCE), "-o", tmp, *_LIBS],
                check=True,
                capture_output=True,
                timeout=_COMPILE_TIMEOUT_S,
            )
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o755 & ~umask)  # mkstemp made it 0600: others sharing the cache must read it too
            os.replace(tmp, target)
        except (OSError, subprocess.SubprocessError):
            continue
        finally:
            Path(tmp).unlink(missing_ok=True)
        yield target


def _trusted(directory: Path) -> bool:
    """A directory whose libraries may be loaded: ours (or the configured model cache) and writable by no one
    else, since a library loaded from it runs as this process."""
    if directory.parent == model_cache_dir():
        return True
    info = directory.stat()
    return info.st_uid == os.getuid() and not info.st_mode & 0o022


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for), so a cache shared between machines
    never hands one CPU another's instructions."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
