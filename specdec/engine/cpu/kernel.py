"""The CPU tier's row kernel: float32 products of a few rows that read each weight once and give a
row the same numbers at any row count (rowkernel.c, built here at load with the host's C compiler
and loaded through ctypes).

Every output is one fused multiply-add chain over the input width, in order, whatever the row
count, so a row's numbers never depend on its batch-mates, as with the per-row products of
rows.py. But up to six rows share each read of a weight panel, and more rows take further blocks
over the panel while it is in cache: on a 2-core Zen 3 the shipped target's matmuls, timed alone,
cost 11-12 ms for 1 to 6 rows, 23 ms for 20 and 65 ms for 80 (bench/results/KERNELS.md has whole
passes against the other plans). Each weight is packed once into panels
of 16 columns; the module keeps its own weight too, which a prefill chunk's GEMM reads.

Built only on x86 CPUs that PyTorch runs with AVX2 (which includes FMA) and where a C compiler
(`$CC`, else `cc` or `gcc`) works; the library is cached by the source's hash under $XDG_CACHE_HOME/specdec
(or a temporary folder). Anything missing is logged, and the CPU tier keeps its other products.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("specdec.engine")

SOURCE = Path(__file__).with_name("rowkernel.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared")
BUILD_TIMEOUT_S = 120


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(root) / "specdec"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    return Path(tempfile.gettempdir())


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built row kernel, or None (the reason logged once)."""
    why = _unsupported()
    if why is None:
        try:
            return _load()
        except (OSError, subprocess.SubprocessError) as e:
            why = f"it did not build or load ({str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__})"
    log.info("CPU row kernel not used: %s; per-row products are batched matmuls", why)
    return None


def _unsupported() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"it is written for x86-64, not {platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"this CPU runs PyTorch at {torch.backends.cpu.get_cpu_capability()}, without AVX2 and FMA"
    if not SOURCE.is_file():
        return f"its source {SOURCE.name} is not installed"
    if _compiler() is None:
        return f"no C compiler ({os.environ.get('CC') or 'cc or gcc'}) on PATH"
    return None


def _compiler() -> str | None:
    """$CC where set, else cc or gcc: the first found on PATH."""
    return next(filter(shutil.which, [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc"]), None)


def _load() -> ctypes.CDLL:
    cc = _compiler()
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join((cc, *FLAGS)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"rowkernel-{key}.so"
    if not target.exists():
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                raise OSError(f"{cc} exited {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
            os.replace(tmp, target)  # atomic: a concurrent load sees a whole library or none
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(target))
    lib.row_product.restype = None
    lib.row_product.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
    lib.panel_width.restype = ctypes.c_long
    return lib


def packed(w: torch.Tensor, width: int) -> torch.Tensor:
    """w [N, K] (out, in) packed in panels of `width` columns of the product: [N / width][K][width],
    the last panel padded with zeros."""
    n, k = w.shape
    panels = -(-n // width)
    padded = torch.zeros(panels * width, k, dtype=torch.float32)
    padded[:n] = w
    return padded.reshape(panels, width, k).transpose(1, 2).contiguous()


def row_forward(m):
    """m's product (a float32 nn.Linear's or Conv1D's) through the row kernel, or None where the
    kernel is not available. The weight is packed once; the module keeps its own."""
    lib = library()
    if lib is None or m.weight.dtype != torch.float32:
        return None
    w = m.weight.detach()
    w = w if isinstance(m, torch.nn.Linear) else w.t()  # [out, in]
    n, k = w.shape
    p = packed(w, lib.panel_width())
    b = None if m.bias is None else m.bias.detach()
    product = lib.row_product

    def run(x: torch.Tensor) -> torch.Tensor:
        r = x.reshape(-1, k).contiguous()
        y = torch.empty(r.shape[0], n, dtype=torch.float32)
        product(r.data_ptr(), p.data_ptr(), y.data_ptr(), r.shape[0], k, n)  # ctypes lets go of the GIL for the call
        if b is not None:
            y = y + b
        return y.reshape(*x.shape[:-1], n)

    return run
