"""The CPU tier's kernels, built here at load with the host's C compiler into one library and
loaded through ctypes: the row kernel, float32 products of a few rows that read each weight once
and give a row the same numbers at any row count (rowkernel.c), and the query attention, each
(query, head) of a per-query group its own problem without SDPA's per-problem set-up (attend.c).

Every output is one fused multiply-add chain over the input width, in order, whatever the row
count, so a row's numbers never depend on its batch-mates, as with the per-row products of
rows.py. But up to six rows share each read of a weight panel, and more rows take further blocks
over the panel while it is in cache: on a 2-core Zen 3 the shipped target's matmuls, timed alone,
cost 11-12 ms for 1 to 6 rows, 23 ms for 20 and 65 ms for 80 (bench/results/KERNELS.md has whole
passes against the other plans). Each weight is packed once into panels
of 16 columns, in bfloat16 where every value of it is a bfloat16 value (a bf16 checkpoint loaded
in float32): the kernel widens them back before the same multiply-adds, so the numbers are the
float32 panels' bit for bit, at half the bytes to stream. The module keeps its own weight too,
which a prefill chunk's GEMM reads.

Both kernels run on torch's thread count (`torch.set_num_threads`, the services' --threads), in
torch's own OpenMP runtime: the row kernel shares out a weight's panels, the query attention its
(query, head) problems, each whole on one thread, so the numbers are the same at any thread count.
A compiler without OpenMP builds them single-threaded (logged at every load).

The query attention (`query_attention`) computes what the per-query layout's SDPA calls compute,
to float rounding: a query's softmax over the keys it sees, in ascending key order, every score
and output element fused multiply-adds in a fixed order, so its numbers, too, never depend on the
batch. At one query over 300 keys it costs a few microseconds a head where SDPA's call costs
tens; in a pass of many sessions' rounds SDPA was as dear as every matmul (bench/results/KERNELS.md).

Used only on x86-64 Linux, on CPUs that PyTorch runs with AVX2 (which includes FMA). A library
prebuilt into the installed package (`python -m specdec.engine.cpu.kernel`, what the draft
image's build stage runs: its runtime has no compiler) is loaded where its sources' hash matches;
else it is built with a C compiler (`$CC`, else `cc` or `gcc`) and cached by the sources' hash in
$XDG_CACHE_HOME/specdec (default ~/.cache/specdec), else in a private folder of the temporary
directory (specdec-<uid>, mode 0700); a folder that another user owns or may write to is not used.
A build leaves the folder its four newest libraries.
Anything missing is logged, and the CPU tier keeps its other products and SDPA.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger("specdec.engine")

SOURCES = tuple(Path(__file__).with_name(name) for name in ("rowkernel.c", "attend.c"))
FLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared")
OPENMP = "-fopenmp"  # added where the compiler takes it (`_build`)
KEEP_BUILDS = 4  # libraries the cache folder keeps, the newest (`_prune`)
TMP_PREFIX = ".kernels-tmp-"  # a build's file until it is whole; one a killed build left is pruned once BUILD_TIMEOUT_S old
BUILD_TIMEOUT_S = 120


def _private(path: Path) -> bool:
    """Whether path is a folder of this user that no one else may write to."""
    st = path.lstat()
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _cache_dir() -> Path:
    """The folder the library is built in and loaded from (OSError where there is none)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for path in (Path(root) / "specdec", Path(tempfile.gettempdir()) / f"specdec-{os.getuid()}"):
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            if _private(path) and os.access(path, os.W_OK):
                return path
        except OSError:
            pass
    raise OSError("no private folder to build it in (the cache folder and the temporary one are not writable, "
                  "or another user may write to them)")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built row kernel, or None (the reason logged once)."""
    why = _unsupported()
    if why is None:
        try:
            return _load()
        except (OSError, subprocess.SubprocessError) as e:
            why = f"it did not build or load ({(str(e).strip().splitlines() or [type(e).__name__])[0]})"
    log.info("CPU tier's kernels not used: %s; per-row products are batched matmuls, attention SDPA's", why)
    return None


def _foreign() -> str | None:
    """Why this machine is not one the kernels are built for (x86-64 Linux), or None."""
    if not sys.platform.startswith("linux") or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"it is built for x86-64 Linux, not {platform.machine()} {sys.platform}"
    return None


def _unsupported() -> str | None:
    if (why := _foreign()) is not None:
        return why
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return (f"PyTorch runs at CPU capability {torch.backends.cpu.get_cpu_capability()} here (this CPU's, or what "
                "ATEN_CPU_CAPABILITY forces), without AVX2 and FMA")
    missing = [s.name for s in SOURCES if not s.is_file()]
    if missing:
        return f"its source {', '.join(missing)} is not installed"
    return None


def _compiler() -> list[str] | None:
    """$CC (a command, perhaps with arguments) where set, else cc or gcc: the first found on PATH."""
    for cc in [shlex.split(os.environ["CC"])] if os.environ.get("CC", "").strip() else [["cc"], ["gcc"]]:
        if shutil.which(cc[0]):
            return cc
    return None


def _package_dir() -> Path:
    """Where a library prebuilt with the package lives (beside its sources)."""
    return SOURCES[0].parent


def _key(source: bytes, *cc: str) -> str:
    """The hash a library is named by: its sources, flags and (for one built at load) compiler."""
    return hashlib.sha256(source + " ".join((*cc, *FLAGS, OPENMP)).encode()).hexdigest()[:16]


def _prebuilt(source: bytes | None = None) -> Path:
    """The prebuilt library's path for these sources (read here unless given) and flags, whichever
    compiler built it."""
    return _package_dir() / f"kernels-prebuilt-{_key(source or b''.join(s.read_bytes() for s in SOURCES))}.so"


def _build(cc: list[str], target: Path) -> bool:
    """Compiles the sources into target, atomically: a concurrent load sees a whole library or none.
    With OpenMP where the compiler takes it, else without (the kernels then run on one thread);
    returns whether with."""
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        why = None  # why the build with OpenMP failed
        for flags in ((*FLAGS, OPENMP), FLAGS):
            # libm after the sources (attend.c's tanhf): loaded where the process has no libm of its own too
            done = subprocess.run([*cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
            if done.returncode == 0:
                break
            lines = (done.stderr or done.stdout).strip().splitlines()
            errors = [x for x in lines if "error" in x.lower() or "cannot find" in x.lower()]
            detail = next((x for x in errors if "ld returned" not in x), errors[0] if errors else lines[0] if lines else "")
            why = f"{cc[0]} exited {done.returncode}: {detail}".rstrip(": ")
        else:
            raise OSError(why)
        if OPENMP not in flags:
            log.info("CPU tier's kernels built without OpenMP (with %s, %s)", OPENMP, why)
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep a prebuilt library from the image's other users
        os.replace(tmp, target)
        return OPENMP in flags
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _used(lib: Path) -> None:
    """Marks a cached library as used now (its modification time), so a prune keeps the libraries
    in use, not the last built."""
    try:
        os.utime(lib)
    except OSError as e:  # a cache folder this process may read but not write: nothing to prune from it either
        log.debug("CPU tier's kernel cache: %s not marked used: %s", lib.name, e)


def _prune(built: Path) -> None:
    """Leaves the cache folder the KEEP_BUILDS libraries used last (built or loaded: `_used`),
    `built` among them: each version of the sources (another checkout, an older release) builds its
    own, and nothing else removes them. A library another process has loaded stays mapped there;
    one it loads later is built again."""
    try:
        others = sorted((p for p in built.parent.glob("kernels-*.so") if p != built), key=lambda p: p.stat().st_mtime, reverse=True)
        for p in others[KEEP_BUILDS - 1 :]:
            p.unlink(missing_ok=True)
    except OSError as e:  # another process pruning meanwhile: what is left goes next time
        log.debug("CPU tier's kernel cache not pruned: %s", e)


def _prune_temporaries(folder: Path) -> None:
    """Removes the temporary files of builds killed part-way (the kubelet's liveness kill), once
    older than a build may take: each start looks, built or loaded."""
    try:
        for p in folder.glob(f"{TMP_PREFIX}*.so"):
            if time.time() - p.stat().st_mtime > BUILD_TIMEOUT_S:
                p.unlink(missing_ok=True)
    except OSError as e:
        log.debug("CPU tier's kernel cache: temporary files not pruned: %s", e)


NOT_MAPPABLE = re.compile(r"map segment|[Pp]ermission denied|not permitted")  # dlopen's words where the folder cannot hold code


def _load() -> ctypes.CDLL:
    source = b"".join(s.read_bytes() for s in SOURCES)
    target = _prebuilt(source)
    if not target.is_file():
        cc = _compiler()
        if cc is None:
            raise OSError(f"no C compiler ({os.environ.get('CC') or 'cc or gcc'}) on PATH, and none prebuilt with the package")
        target = _cache_dir() / f"kernels-{_key(source, *cc)}.so"
        _prune_temporaries(target.parent)
        if not target.exists():
            _build(cc, target)
            _prune(target)
        else:
            _used(target)
            try:
                ctypes.CDLL(str(target))
            except OSError as e:  # a cached library that does not load (cut short, or built against another runtime)
                # turned the kernels off at every start until removed by hand: built again, replacing it (_build's
                # os.replace); not where no library loads from the folder (a noexec mount): a build at every start
                if NOT_MAPPABLE.search(str(e)):
                    raise
                log.info("CPU tier's cached kernels %s do not load (%s); building them again", target.name, e)
                _build(cc, target)
    lib = ctypes.CDLL(str(target))
    for product in (lib.row_product, lib.row_product_bf16):
        product.restype = None
        product.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.panel_width.restype = ctypes.c_int64
    lib.avx512.restype, lib.avx512.argtypes = ctypes.c_int, [ctypes.c_int]
    lib.threaded.restype = ctypes.c_int
    lib.attend_queries.restype = ctypes.c_int
    lib.attend_queries.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_float, ctypes.c_int]
    if not lib.threaded():  # every load says so: a library built once without OpenMP is cached and loaded as it is
        log.info("CPU tier's kernels run on one thread whatever --threads says: %s was built without OpenMP "
                 "(delete it to build again)", target)
    return lib


def threaded() -> bool:
    """Whether the kernels run on torch's thread count (built with OpenMP), not on one thread."""
    lib = library()
    return lib is not None and bool(lib.threaded())


def packed(w: torch.Tensor, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w [N, K] (out, in) packed in panels of `width` columns of the product: [N / width][K][width],
    the last panel padded with zeros; in `dtype` from the first copy (a float32 pad and transpose
    before a bfloat16 cast held 4x the packed bytes at once: 4 GB for a 128k-word head)."""
    n, k = w.shape
    panels = -(-n // width)
    padded = torch.zeros(panels * width, k, dtype=dtype)
    padded[:n] = w
    return padded.reshape(panels, width, k).transpose(1, 2).contiguous()


def avx512(on: bool | None = None) -> bool:
    """Whether the row kernel's products run its AVX-512 code (rowkernel.c: the same numbers, more
    rows a read of each panel), which it does where the CPU has AVX-512F; on=False turns it off
    and on=True back on where the CPU has it (tests, benchmarks). False where the library is not
    available."""
    lib = library()
    return lib is not None and bool(lib.avx512(-1 if on is None else int(on)))


def bf16_exact(w: torch.Tensor) -> bool:
    """Whether every value of the float32 tensor w is a bfloat16 value (a bf16 checkpoint's weight
    loaded in float32): the low 16 bits of each are zero, so its upper half, packed in bfloat16,
    loses nothing. A test of the bits, not of the values: no float mode (flushed subnormals) can
    make it pass wrongly."""
    low = 0 if sys.byteorder == "little" else 1  # the int16 half of each float32 that holds its low bits
    return not w.contiguous().view(torch.int16)[..., low::2].any()  # (no int32 copy of the weight, as `& 0xFFFF` made)


def row_forward(m, half: bool | None = None):
    """m's product (a float32 nn.Linear's or Conv1D's) through the row kernel, or None where the
    kernel is not available. The weight is packed once, in bfloat16 where that is exact
    (half=None decides with `bf16_exact`; otherwise half is the caller's own `bf16_exact` of this
    weight, or False to keep float32) and float32 otherwise: the same
    numbers either way, half the bytes to stream in bfloat16. The module keeps its own weight.
    The product's `packed` attribute is the packed weight."""
    lib = library()
    if lib is None or m.weight.dtype != torch.float32:
        return None
    w = m.weight.detach()
    w = w if isinstance(m, torch.nn.Linear) else w.t()  # [out, in]
    n, k = w.shape
    half = bf16_exact(w) if half is None else half
    p = packed(w, lib.panel_width(), torch.bfloat16 if half else torch.float32)
    b = None if m.bias is None else m.bias.detach()
    product = lib.row_product_bf16 if half else lib.row_product

    weights = p.data_ptr()  # p lives as long as run: its default argument below holds it

    def run(x: torch.Tensor, _panels: torch.Tensor = p) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_cpu or x.shape[-1] != k:
            raise ValueError(f"the row kernel multiplies float32 CPU rows of width {k}, not {x.dtype} {x.device} rows of width {x.shape[-1]}")
        r = x.reshape(-1, k).contiguous()
        rows = r.shape[0]
        y = torch.empty(rows, n, dtype=torch.float32)
        product(r.data_ptr(), weights, y.data_ptr(), rows, k, n, torch.get_num_threads())  # ctypes lets go of the GIL
        if b is not None:
            y = y + b
        return y.view(*x.shape[:-1], n)

    run.packed = p
    return run


HEAD_DIMS = range(8, 257, 8)  # the head sizes the query attention takes


def query_attention():
    """The query attention (attend.c), or None where the library is not available. Its call:
    q [B, n, H, D], k and v [B, L, H_kv, D], visible [B, n, L] (bool), scale -> [B * n, H, D]; or,
    with `slots` [B, L] (int32), k and v a pool [S, H_kv, D] read in place, slots[b, j] the pool row
    of input b's key position j (a slot outside the pool is an IndexError; keys it does not see are
    never read); `softcap` > 0 caps the scaled scores at softcap * tanh(score / softcap) (Gemma 2). None for heads it does not take (not float32 CPU tensors, D not in HEAD_DIMS, H
    not a multiple of H_kv, values of another size than keys): those attend through SDPA, every
    pass alike."""
    lib = library()
    if lib is None:
        return None
    fn = lib.attend_queries

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
            slots: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor | None:
        B, n, H, D = q.shape
        if slots is None:  # one input's keys after another's: a pool of B * L rows, in order
            if k.dim() != 4 or v.dim() != 4 or k.shape[0] != B or v.shape[:2] != k.shape[:2]:
                return None
            L = k.shape[1]
            k, v = k.reshape(B * L, *k.shape[2:]), v.reshape(B * L, *v.shape[2:])
            slots = torch.arange(B * L, dtype=torch.int32).view(B, L)
        L, H_kv = slots.shape[-1], k.shape[-2]
        if not (all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (q, k, v)) and D in HEAD_DIMS and H % H_kv == 0
                and k.dim() == 3 and k.shape[-1] == D and v.shape == k.shape):
            return None
        if slots.dtype != torch.int32 or slots.shape != (B, L):
            raise ValueError(f"the query attention's slots: expected int32 {(B, L)}, got {slots.dtype} {tuple(slots.shape)}")
        if visible.dtype != torch.bool or visible.shape != (B, n, L):
            raise ValueError(f"the query attention's visible keys: expected bool {(B, n, L)}, got {visible.dtype} {tuple(visible.shape)}")
        q, k, v, slots, visible = q.contiguous(), k.contiguous(), v.contiguous(), slots.contiguous(), visible.contiguous()
        out = torch.empty(B * n, H, D, dtype=torch.float32)
        failed = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), slots.data_ptr(), visible.data_ptr(), out.data_ptr(),
                    B, n, H, H_kv, D, L, k.shape[0], scale, softcap, torch.get_num_threads())
        if failed == -2:
            raise IndexError(f"the query attention's slots name a key outside the pool of {k.shape[0]} rows")
        if failed:
            raise MemoryError("the query attention could not allocate its scratch memory")
        return out

    return run


def prebuild() -> tuple[Path, bool]:
    """Builds the library into the installed package (where a runtime without a compiler finds it);
    returns its path and whether it was built with OpenMP. OSError where there is no compiler or it
    fails."""
    cc = _compiler()
    if cc is None:
        raise OSError(f"no C compiler ({os.environ.get('CC') or 'cc or gcc'}) on PATH")
    target = _prebuilt()
    return target, _build(cc, target)


def main() -> int:
    """python -m specdec.engine.cpu.kernel: prebuilds the library into the installed package; on a
    machine the kernels are not for (an arm64 image), says so and succeeds: the services run without them."""
    if (why := _foreign()) is not None:
        print(f"specdec.engine.cpu.kernel: nothing to build: {why} (the CPU tier runs without its kernels)")
        return 0
    try:
        built, threads = prebuild()
        print(f"built {built}" + ("" if threads else " (without OpenMP: the kernels run on one thread)"))
        return 0
    except (OSError, subprocess.SubprocessError) as e:
        print(f"specdec.engine.cpu.kernel: not built: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
