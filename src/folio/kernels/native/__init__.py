"""Native CPU kernels, built on first use with the system C compiler.

- `paged_attention.c`: attention of a step's tokens through the block tables
  (wrapped in `attention.py`).
- `elementwise.c`: residual add + RMSNorm, rotary embedding, SiLU-and-multiply,
  greedy sampling, sampling's random draws (the exponential race),
  penalties read from persistent counts, top-k and top-p without a sort.
- `linear.c`: the bf16 linear layer, on CPUs with AVX512-BF16 (many rows on
  the AMX tiles where the CPU has them).
- `linear_avx2.c`: an fp32 linear layer whose weights are stored as bf16, on
  CPUs with AVX2 and FMA (half the bytes of fp32 weights per step).
- `fp8linear.c`: an fp32 linear layer whose weights are fp8 (e4m3) codes with
  a scale per output feature and block of input features, on CPUs with AVX2,
  FMA and F16C (`layers/quantization/fp8.py`).
- `qlinear.c`: the linear layer of 4- and 8-bit quantized weights (codes,
  scales and offsets per group: `layers/quantization/int_groups.py`), on CPUs
  with AVX2 and FMA or AVX-512; compiled as five units, one a path, so that
  its long -O3 build runs on every core (`_UNITS`).
- `decoder.c`: every decoder layer of a step in one call, from the kernels
  above (wrapped in `decoder.py`).
- `lora.c`: LoRA of several adapters in one step, grouped by adapter
  (wrapped in `lora.py`).
- `moe.c`: a mixture-of-experts layer's router (product, softmax, top-k).

The C sources ship with the package; they are compiled once per machine (the
cache key includes the sources and the CPU's flags, since they are built with
-march=native) into one library in ~/.cache/folio/kernels, called through
ctypes, which releases the GIL. Without a compiler the torch layers are used.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger("folio")

_DIR = Path(__file__).parent
_SOURCES = [_DIR / "paged_attention.c", _DIR / "elementwise.c", _DIR / "linear.c",
            _DIR / "linear_avx2.c", _DIR / "fp8linear.c", _DIR / "decoder.c", _DIR / "qlinear.c",
            _DIR / "lora.c", _DIR / "moe.c"]
_HEADERS = [_DIR / "bf16.h", _DIR / "simd.h"]
# What the compiler is run on: qlinear.c as five units, each one of its paths
# (FOLIO_QLINEAR_PART, see its head: its -O3 build is ~56 s in one unit, ~24
# for the longest part), the longest first so that the cores finish together.
_UNITS = ([(_DIR / "qlinear.c", f"qlinear{n}", (f"-DFOLIO_QLINEAR_PART={n}",))
           for n in (4, 3, 1, 2)]
          + [(_DIR / "paged_attention.c", "paged_attention", ())]
          + [(src, src.stem, ()) for src in _SOURCES
             if src.name not in ("qlinear.c", "paged_attention.c")]
          + [(_DIR / "qlinear.c", "qlinear0", ("-DFOLIO_QLINEAR_PART=0",))])
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False


def _cpuinfo_line(keys: tuple[str, ...]) -> Optional[str]:
    """The first /proc/cpuinfo line that starts with one of `keys` (None: none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(keys)), None)
    except OSError:
        return None


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> str:
    return _cpuinfo_line(("flags", "Features")) or platform.processor()


@functools.lru_cache(maxsize=None)
def _cpu_vendor() -> str:
    line = _cpuinfo_line(("vendor_id",))
    return line.split(":", 1)[1].strip() if line else ""


def _vendor_defines() -> tuple[str, ...]:
    """What a build on this CPU's vendor defines: on Intel the quantized
    kernels ask for their codes ahead into L2 (prefetcht1), which read a
    one-row pass over the 1B Q4_K_M 1.08-1.16x faster than into L1 on a Xeon
    (qlinear.c's FOLIO_QL_PREFETCH_LOCALITY); AMD's Zen 4 and 5, measured
    with L1 (8 KiB ahead: 0.84 of the read bandwidth), keep it."""
    return ("-DFOLIO_QL_PREFETCH_LOCALITY=2",) if _cpu_vendor() == "GenuineIntel" else ()


# -mno-<feature> -> the /proc/cpuinfo flag of that feature
_FEATURE_FLAGS = {"avx512f": "avx512f", "avxvnni": "avx_vnni", "avx2": "avx2"}


def _no_op(flag: str) -> bool:
    """Whether a -mno-<feature> flag turns off what this CPU does not have anyway
    (so -march=native never enabled it)."""
    feature = _FEATURE_FLAGS.get(flag[len("-mno-"):]) if flag.startswith("-mno-") else None
    return feature is not None and feature not in _cpu_flags().split()


def distinct_build(flags: tuple[str, ...]) -> bool:
    """Whether the library built with these extra flags differs from this
    machine's own (tests run each distinct build once)."""
    return any(not _no_op(f) for f in flags)


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "folio" / "kernels"


def library_path(extra_flags: tuple[str, ...] = ()) -> Path:
    """Where the library built with these flags is cached: named by the
    sources, this CPU's flags and the build's own."""
    source = b"".join(p.read_bytes() for p in _SOURCES + _HEADERS)
    key = hashlib.sha256(source + _cpu_flags().encode() + platform.machine().encode()
                         + " ".join(_vendor_defines() + extra_flags).encode()
                         + repr([(u[1], u[2]) for u in _UNITS]).encode())
    return _cache_dir() / f"folio_cpu_{key.hexdigest()[:16]}.so"


def _build(extra_flags: tuple[str, ...] = (), niced: bool = False) -> Optional[ctypes.CDLL]:
    """Compile (once per source, CPU and flags) and load the kernel library;
    `extra_flags` lets the tests build the portable path too (-mno-avx512f);
    `niced`: the compilers at a lower priority (a build made ahead, in the
    background, while other work runs: `prebuild`)."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: the torch layers run instead of the native kernels")
        return None
    # -mno-X of a feature this CPU lacks changes nothing: the same library
    extra_flags = tuple(f for f in extra_flags if not _no_op(f))
    target = library_path(extra_flags)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with _builder(target):
            if not target.exists():     # another thread or process built it meanwhile
                if not _compile(compiler, extra_flags, target, niced):
                    return None
    lib = ctypes.CDLL(str(target))
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    signatures = {
        "folio_paged_attention": (ctypes.c_int, [p, i64, p, p, p, i64, p, p, i64] + [i32] * 4
                                  + [i64, f32, i32, i32, i32]),
        "folio_paged_attention_window": (ctypes.c_int, [p, i64, p, p, p, i64, p, p, i64]
                                         + [i32] * 4 + [i64, f32, i32, i32, i32, i64]),
        "folio_add_rmsnorm": (None, [p] * 4 + [i64, i64, f32, i32, i32, i32]),
        "folio_rotary": (None, [p, i64, i64, i32, i32, p, p, i32, i32]),
        "folio_head_rmsnorm": (None, [p, i64, i64, i32, i32, p, f32, i32, i32]),
        "folio_silu_mul": (None, [p, p, i64, i64, i32, i32]),
        "folio_greedy": (None, [p, p, p, i64, i64, i32, i32]),
        "folio_dequantize_rows": (ctypes.c_int, [p, i64, p, p, i32, p, p, i32, p, i64, p,
                                                 i64, i64, i64, i64, p, i32, i32]),
        "folio_race": (None, [p, p, p, i64, i64, i32]),
        "folio_penalize": (None, [p] * 8 + [i64, i64, i32]),
        "folio_top_k_top_p": (None, [p, i64, i64, p, p, i32]),
        "folio_attention_splits": (None, [i32]),
        "folio_linear_available": (ctypes.c_int, []),
        "folio_linear_amx": (ctypes.c_int, []),
        "folio_linear": (None, [p, i64, p, p, p, i64, i64, i64, i32]),
        "folio_linear_bf16w_available": (ctypes.c_int, []),
        "folio_linear_bf16w": (None, [p, i64, p, p, p, i64, i64, i64, i32]),
        "folio_fp8_linear_available": (ctypes.c_int, []),
        "folio_fp8_linear": (ctypes.c_int, [p, i64, p, p, i64, p, p, i64, i64, i64, i32]),
        "folio_decoder_layers": (ctypes.c_int, [p, i32, p]),
        "folio_qlinear_available": (ctypes.c_int, []),
        "folio_qlinear_int8_rows": (ctypes.c_int, [i32]),
        "folio_attention_vector_width": (ctypes.c_int, []),
        "folio_lora": (ctypes.c_int, [p, i64, p, i64, i32, p, p, i32, p, i64, i64, i64, i64,
                                      i32]),
        "folio_moe_route": (ctypes.c_int, [p, i64, i32, p, i32, i64, i64, i32, i32, i32, p, p,
                                           i32]),
        "folio_qlinear": (ctypes.c_int, [p, i64, i32, p, p, i32, p, p, i32, p, i64, p, i64,
                                         p, p, i64, i64, i64, i32, i32]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    # a decode's context split across threads only when asked: splits make a
    # request's arithmetic depend on its batch (paged_attention.c)
    lib.folio_attention_splits(_splits_asked())
    return lib


def _splits_asked() -> int:
    """FOLIO_ATTENTION_SPLITS=1: decode attention may split a context."""
    return int(os.environ.get("FOLIO_ATTENTION_SPLITS", "0") == "1")


@contextlib.contextmanager
def _builder(target: Path):
    """Held while `target` is built: one builder a library across threads and
    processes (a test's engine process, pytest's own build ahead), the others
    wait for it and load what it built instead of compiling it again."""
    try:
        import fcntl
    except ImportError:             # not POSIX: builders may overlap (os.replace keeps it whole)
        yield
        return
    with open(target.with_suffix(".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile(compiler: str, extra_flags: tuple[str, ...], target: Path, niced: bool) -> bool:
    """Build the library at `target`: one compiler a unit, as many at once as
    there are cores, then one link; False (and a warning) where it failed."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        nice = ["nice", "-n", "10"] if niced and shutil.which("nice") else []
        flags = [*nice, compiler, "-O3", "-march=native", *_vendor_defines(), *extra_flags,
                 "-ffast-math", "-fopenmp", "-fPIC"]
        objects = [Path(tmp) / f"{name}.o" for _, name, _ in _UNITS]
        pending = [(flags + [*defines, "-c", str(src), "-o", str(obj)])
                   for (src, _, defines), obj in zip(_UNITS, objects)]
        errors = _run_all(pending, max(1, os.cpu_count() or 1))
        if not errors:
            errors = _run_all([[compiler, "-fopenmp", "-shared", *map(str, objects),
                                "-o", str(out), "-lm"]], 1)
        if errors:
            logger.warning("building the native CPU kernels failed, using the torch "
                           "layers:\n%s", errors[-2000:])
            return False
        os.replace(out, target)        # atomic: a reader sees the whole library or none
    return True


def prebuild(flag_sets: list[tuple[str, ...]]) -> threading.Thread:
    """Build these variants of the library (extra compiler flags each) in a
    background thread, so that whoever needs one later finds it built or
    waits for this build instead of starting its own (the test suite builds
    its variants this way while its first tests run). The machine's own
    build (no flags), which nearly everything loads, at the usual priority;
    the others niced, behind the work that runs meanwhile."""
    def run():
        for flags in flag_sets:
            try:
                _build(tuple(flags), niced=bool(flags))
            except OSError as e:        # the test that needs it builds it and says why
                logger.warning("building the native kernels with %s ahead failed: %s", flags, e)
    thread = threading.Thread(target=run, name="folio-kernels-prebuild", daemon=True)
    thread.start()
    return thread


def _run_all(commands: list[list[str]], jobs: int) -> str:
    """Run the commands, `jobs` at a time; the stderr of those that failed."""
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        done = list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True),
                             commands))
    return "".join(d.stderr for d in done if d.returncode != 0)


def load() -> Optional[ctypes.CDLL]:
    """The kernel library, or None when it cannot be built here."""
    global _lib, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _lib = _build()
            except OSError as e:
                logger.warning("native CPU kernels unavailable (%s): using the torch layers", e)
                _lib = None
        return _lib


@contextlib.contextmanager
def attention_splits(lib: Optional[ctypes.CDLL] = None):
    """Within: decode attention may split a context across threads (what
    FOLIO_ATTENTION_SPLITS=1 turns on for a whole run); the tests' switch."""
    lib = lib or load()
    lib.folio_attention_splits(1)
    try:
        yield
    finally:
        lib.folio_attention_splits(_splits_asked())


def dtype_code(dtype: torch.dtype) -> int:
    """The kernels' code for a dtype (0: float32, 1: bfloat16)."""
    return _DTYPE_CODES[dtype]


def supports(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in _DTYPE_CODES and load() is not None


def fuses(x: torch.Tensor) -> bool:
    """Whether the fused element-wise kernels serve this tensor: bf16 on the CPU.
    fp32 keeps the torch layers, bit-identical to the reference implementation."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and load() is not None


def has_bf16_linear() -> bool:
    """Whether the library has the AVX512-BF16 linear kernel (the CPU runs it)."""
    lib = load()
    return lib is not None and bool(lib.folio_linear_available())


def has_amx_linear() -> bool:
    """Whether the native bf16 kernel multiplies many rows on the AMX tiles
    (built for a CPU with AMX, by a compiler that knows it, and the OS lets
    this process use them)."""
    lib = load()
    return lib is not None and bool(lib.folio_linear_amx())


def prefers_onednn_bf16() -> bool:
    """CPUs with AMX keep oneDNN for bf16 products where the native kernel has
    no AMX path of its own (oneDNN's multiplies on the tiles); not while a
    model that asked for the native kernel packs its weights
    (`native_bf16_over_amx`)."""
    return "amx_bf16" in _cpu_flags().split() and not has_amx_linear() and not _over_amx


_over_amx = 0       # models packing inside native_bf16_over_amx()


@contextlib.contextmanager
def native_bf16_over_amx():
    """bf16 weights packed inside this block (by any thread of the process)
    take the native kernel, and so the one-call decoder, even on an AMX CPU:
    a mixture of experts' experts see a few rows a step (T * k / E), where
    the AMX tiles do not fill (docs/benchmarks.md, "A mixture of experts in
    the one-call decoder")."""
    global _over_amx
    with _lock:
        _over_amx += 1
    try:
        yield
    finally:
        with _lock:
            _over_amx -= 1


def packs_linear(weight: torch.Tensor) -> bool:
    """Whether `linear` serves this weight: bf16 [N, K] on the CPU, K even, a
    library built with AVX512-BF16, and no AMX (prefers_onednn_bf16)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and weight.shape[1] % 2 == 0 and has_bf16_linear()
            and not prefers_onednn_bf16())


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> the layout `linear` reads: output features in tiles of 16
    (zero-padded), each pair of input features' weights side by side:
    [tiles, K/2, 16, 2]."""
    n, k = weight.shape
    tiles = -(-n // 16)
    padded = torch.zeros(tiles * 16, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(tiles, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, n: int,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] bf16 @ W^T (+ bias) with W packed by `pack_linear`: [..., n] bf16."""
    return _linear_call(load().folio_linear, x, packed, n, packed.shape[1] * 2, bias)


def _linear_call(fn, x: torch.Tensor, packed: torch.Tensor, n: int, k: int,
                 bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [..., k] (rows may be strided, each row dense) -> [..., n] in x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*lead, n, dtype=x.dtype)
    bias = None if bias is None else bias.to(x.dtype).contiguous()
    if x2.shape[0]:
        fn(x2.data_ptr(), x2.stride(0), packed.data_ptr(),
           None if bias is None else bias.data_ptr(), out.data_ptr(), x2.shape[0], n, k,
           torch.get_num_threads())
    return out


def packs_linear_bf16w(weight: torch.Tensor) -> bool:
    """Whether `linear_bf16w` serves this weight: [N, K] on the CPU and a library
    built with AVX2 and FMA."""
    lib = load() if weight.device.type == "cpu" and weight.dim() == 2 else None
    return lib is not None and bool(lib.folio_linear_bf16w_available())


def pack_linear_bf16w(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] (any float dtype) -> bf16 (rounded to nearest even, as torch rounds) in
    the layout `linear_bf16w` reads: output features in tiles of 8 (zero-padded),
    each input feature's 8 weights side by side: [tiles, K, 8]."""
    n, k = weight.shape
    tiles = -(-n // 8)
    padded = torch.zeros(tiles * 8, k, dtype=torch.bfloat16)
    padded[:n] = weight.detach().to(torch.bfloat16)
    return padded.view(tiles, 8, k).transpose(1, 2).contiguous()


def linear_bf16w(x: torch.Tensor, packed: torch.Tensor, n: int,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] fp32 @ W^T (+ bias) with W packed by `pack_linear_bf16w`: [..., n] fp32."""
    k = packed.shape[1]
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != k:
        raise ValueError(f"linear_bf16w takes fp32 [..., {k}] on the CPU, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    return _linear_call(load().folio_linear_bf16w, x, packed, n, k, bias)


def has_fp8_linear() -> bool:
    """Whether the library has `fp8_linear` (built with AVX2, FMA and F16C)."""
    lib = load()
    return lib is not None and bool(lib.folio_fp8_linear_available())


def pack_fp8_linear(codes: torch.Tensor, scales: torch.Tensor,
                    block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes [N, K] (uint8 or float8_e4m3fn) and fp32 scales [N, KB] (one
    per output feature and block of `block` inputs, KB = ceil(K / block)) ->
    the layout `fp8_linear` reads: output features in tiles of 16 (zero-padded),
    codes [tiles, K, 16] uint8 and scales [tiles, KB, 16] fp32 times 2^8 (the
    kernel widens a code to its value times 2^-8)."""
    n, k = codes.shape
    blocks = -(-k // block)
    if scales.shape != (n, blocks):
        raise ValueError(f"fp8 scales {tuple(scales.shape)} for [{n}, {k}] codes in blocks of "
                         f"{block}: expected [{n}, {blocks}]")
    tiles = -(-n // 16)
    c = torch.zeros(tiles * 16, k, dtype=torch.uint8)
    c[:n] = codes.view(torch.uint8) if codes.dtype != torch.uint8 else codes
    s = torch.zeros(tiles * 16, blocks, dtype=torch.float32)
    s[:n] = scales.float() * 256.0
    return (c.view(tiles, 16, k).transpose(1, 2).contiguous(),
            s.view(tiles, 16, blocks).transpose(1, 2).contiguous())


def fp8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: int, n: int,
               bias: Optional[torch.Tensor] = None, *,
               lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """x [..., K] fp32 @ W^T (+ bias) with W's codes and scales packed by
    `pack_fp8_linear`: [..., n] fp32."""
    k = codes.shape[1]
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != k:
        raise ValueError(f"fp8_linear takes fp32 [..., {k}] on the CPU, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    lib = lib or load()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*lead, n, dtype=torch.float32)
    bias = None if bias is None else bias.float().contiguous()
    if x2.shape[0] and lib.folio_fp8_linear(
            x2.data_ptr(), x2.stride(0), codes.data_ptr(), scales.data_ptr(), block,
            None if bias is None else bias.data_ptr(), out.data_ptr(), x2.shape[0], n, k,
            torch.get_num_threads()):
        raise MemoryError("fp8_linear: no memory for the widened tiles")
    return out


def runs_qlinear(x: torch.Tensor) -> bool:
    """Whether `qlinear` serves activations x: fp32 or bf16 on the CPU, with a
    library built with AVX2 and FMA (or AVX-512)."""
    if x.device.type != "cpu" or x.dtype not in _DTYPE_CODES:
        return False
    lib = load()
    return lib is not None and bool(lib.folio_qlinear_available())


# qlinear's quantize_x: int8 at the row counts where it wins (qlinear.c's
# folio_qlinear_int8_rows), else int16 for bf16 and fp32 arithmetic for fp32
QLINEAR_INT8_AT_FEW_ROWS = 3


def qlinear(x: torch.Tensor, w, bias: Optional[torch.Tensor] = None, *,
            quantize_x: int = 0, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) with W an `IntGroups` (4-, 6- or 8-bit codes,
    a scale and offset per group): [..., N] in x's dtype.
    `quantize_x`: 0 (or False) fp32 arithmetic on the codes; 1 (or True) x
    quantized to int16 per block of 32 positions and multiplied as integers;
    2 the same in int8 (fewest instructions, x's int8 rounding); 3
    (QLINEAR_INT8_AT_FEW_ROWS) int8 at few rows, else as 0 or 1 by x's dtype.
    `lib`: the tests' other builds. A RowParts: each part's product, side by side."""
    parts = getattr(w, "parts", None)
    if parts is not None:
        outs, first = [], 0
        for part in parts:
            end = first + part.out_features
            outs.append(qlinear(x, part, None if bias is None else bias[first:end],
                                quantize_x=quantize_x, lib=lib))
            first = end
        return torch.cat(outs, dim=-1)
    k = w.in_features
    weights, (n, positions) = w.kernel_args
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*lead, n, dtype=x.dtype)
    if bias is not None:
        bias = bias.float().contiguous()
    failed = x2.shape[0] and (lib or load()).folio_qlinear(
        x2.data_ptr(), x2.stride(0), _DTYPE_CODES[x.dtype], *weights,
        None if bias is None else bias.data_ptr(), out.data_ptr(), x2.shape[0], n,
        positions, int(quantize_x), torch.get_num_threads())
    if failed == 2:
        raise ValueError(f"two-level scales in super-groups of {w.per_super} groups: "
                         "the kernel takes a power of two")
    if failed:
        raise MemoryError("the quantized linear kernel could not allocate its scratch memory")
    return out


def moe_route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool,
              weights_in_float: bool, lib: Optional[ctypes.CDLL] = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE layer's routing of x [T, H] (fp32 or bf16) by router [E, H] (fp32):
    (weights [T, k], expert ids [T, k]), as layers/moe.py's route of the
    Router's logits gives them (moe.c says how they round); the weights in
    fp32 where `weights_in_float`, else in x's dtype. `lib`: the tests' other
    builds."""
    x = x.contiguous()
    tokens, hidden = x.shape
    experts = router.shape[0]
    if router.dtype != torch.float32 or router.shape[1] != hidden or not router.is_contiguous():
        raise ValueError(f"moe_route takes a contiguous fp32 router of [E, {hidden}], got "
                         f"{router.dtype} {tuple(router.shape)}")
    weights = torch.empty(tokens, top_k, dtype=torch.float32)
    ids = torch.empty(tokens, top_k, dtype=torch.int64)
    if (lib or load()).folio_moe_route(
            x.data_ptr(), hidden, _DTYPE_CODES[x.dtype], router.data_ptr(), experts, hidden,
            tokens, top_k, int(renormalize), int(weights_in_float), weights.data_ptr(),
            ids.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"moe_route takes 1 to {MAX_ROUTED_EXPERTS} experts and a top_k of "
                         f"at most their number, got {experts} and {top_k}")
    return (weights if weights_in_float else weights.to(x.dtype)), ids


MAX_ROUTED_EXPERTS = 1024       # moe.c's FOLIO_MAX_EXPERTS


def add_rmsnorm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), the sum written into `residual`;
    without a residual, (norm(x), x). x, residual: [T, hidden] contiguous."""
    x = x.contiguous()
    out = torch.empty_like(x)
    rows, hidden = x.shape
    load().folio_add_rmsnorm(x.data_ptr(), 0 if residual is None else residual.data_ptr(),
                           weight.data_ptr(), out.data_ptr(), rows, hidden, eps,
                           _DTYPE_CODES[x.dtype], residual is not None, torch.get_num_threads())
    return out, (x if residual is None else residual)


def head_rmsnorm_(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """RMSNorm in place over each head of x [T, heads, D] (rows may be strided,
    heads and D dense), one weight [D] for all heads. `lib`: the tests' other builds."""
    tokens, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim:
        raise ValueError("head_rmsnorm_ needs each token's heads packed together")
    (lib or load()).folio_head_rmsnorm(x.data_ptr(), tokens, x.stride(0), heads, dim,
                                       weight.data_ptr(), eps, _DTYPE_CODES[x.dtype],
                                       torch.get_num_threads())
    return x


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] in place (rows may be strided, heads and D dense);
    cos, sin: fp32 with T rows of D/2."""
    tokens, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim:
        raise ValueError("rotary_ needs each token's heads packed together")
    cos, sin = cos.contiguous(), sin.contiguous()
    load().folio_rotary(x.data_ptr(), tokens, x.stride(0), heads, dim, cos.data_ptr(),
                      sin.data_ptr(), _DTYPE_CODES[x.dtype], torch.get_num_threads())
    return x


def silu_mul(gate_up: torch.Tensor, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """[T, 2d] (gate then up) -> silu(gate) * up, [T, d]. `lib`: the tests'
    other builds."""
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    (lib or load()).folio_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2,
                        _DTYPE_CODES[gate_up.dtype], torch.get_num_threads())
    return out


def dequantize_rows(w, ids: torch.Tensor, dtype: torch.dtype,
                    lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """An embedding lookup in a table kept in its codes (an `IntGroups` on the
    CPU): its float rows `ids` [*ids.shape, K] in dtype (fp32 or bf16), the
    same to the bit as `w.dequantize_rows(ids, dtype)` (elementwise.c), in
    microseconds where those torch ops take tenths of a millisecond.
    `lib`: the tests' other builds."""
    (perm, codes, bits, scales, offsets, zeros, supers, per_super, bounds, groups), \
        (_, positions) = w.kernel_args
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(*ids.shape, w.in_features, dtype=dtype)
    if (lib or load()).folio_dequantize_rows(
            flat.data_ptr(), flat.numel(), perm, codes, bits, scales, offsets, zeros, supers,
            per_super, bounds, groups, positions, w.in_features, w.out_features,
            out.data_ptr(), _DTYPE_CODES[dtype], torch.get_num_threads()):
        raise IndexError(f"token ids out of range 0..{w.out_features - 1}")
    return out


def greedy(logits: torch.Tensor, lib: Optional[ctypes.CDLL] = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 or bf16 logits [S, V] -> (argmax [S] int64, its log-softmax value [S]
    fp32). `lib`: the tests' other builds."""
    logits = logits.contiguous()
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    (lib or load()).folio_greedy(logits.data_ptr(), tokens.data_ptr(), logprobs.data_ptr(), rows, vocab,
                        _DTYPE_CODES[logits.dtype], torch.get_num_threads())
    return tokens, logprobs


def race(probs: torch.Tensor, keys: torch.Tensor, lib: Optional[ctypes.CDLL] = None
         ) -> torch.Tensor:
    """fp32 weights [R, V], int64 keys [R] -> each row's draw [R] int64 (the
    exponential race of model/layers/draws.py). `lib`: the tests' other
    builds."""
    probs, keys = probs.float().contiguous(), keys.contiguous()
    rows, vocab = probs.shape
    tokens = torch.empty(rows, dtype=torch.int64)
    (lib or load()).folio_race(probs.data_ptr(), keys.data_ptr(), tokens.data_ptr(), rows,
                               vocab, torch.get_num_threads())
    return tokens


def penalize(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor,
             rows: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
             repetition: torch.Tensor, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """fp32 logits [S, V]; the persistent counts [R, V] fp32 and seen [R, V]
    bool; rows [S] int64 (each logits row's table row); the penalties [S] fp32
    -> the penalized logits, a new [S, V]. `lib`: the tests' other builds."""
    logits = logits.float().contiguous()
    out = torch.empty_like(logits)
    n, vocab = logits.shape
    args = [t.contiguous() for t in (counts, seen, rows, presence, frequency, repetition)]
    (lib or load()).folio_penalize(logits.data_ptr(), out.data_ptr(),
                                   *[t.data_ptr() for t in args], n, vocab,
                                   torch.get_num_threads())
    return out


def top_k_top_p_(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                 top_p: Optional[torch.Tensor], lib: Optional[ctypes.CDLL] = None
                 ) -> torch.Tensor:
    """fp32 logits [S, V], contiguous: the tokens outside each row's top k
    (int64 [S], or None) and top p (fp32 [S], or None) set to -inf, in place,
    without sorting (selection and partitions). `lib`: the tests' other
    builds."""
    rows, vocab = logits.shape
    k = None if top_k is None else top_k.to(torch.int64).contiguous()
    p = None if top_p is None else top_p.float().contiguous()
    (lib or load()).folio_top_k_top_p(logits.data_ptr(), rows, vocab,
                                      None if k is None else k.data_ptr(),
                                      None if p is None else p.data_ptr(),
                                      torch.get_num_threads())
    return logits


# paged attention's wrapper lives in attention.py (re-exported: native.paged_attention)
from folio.kernels.native.attention import kv_code, paged_attention  # noqa: E402,F401
