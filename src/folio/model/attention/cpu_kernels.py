"""Native CPU attention kernels, built on first use with the system C compiler.

The C source ships with the package; it is compiled once per machine (the
cache key includes the source and the CPU's flags, since it is built with
-march=native) into ~/.cache/folio/kernels and called through ctypes, which
releases the GIL. Without a compiler the torch backend's own paths are used.
"""

from __future__ import annotations

import ctypes
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

_SOURCE = Path(__file__).with_name("paged_attention_cpu.c")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "folio" / "kernels"


def _build(extra_flags: tuple[str, ...] = ()) -> Optional[ctypes.CDLL]:
    """Compile (once per source, CPU and flags) and load the kernel library;
    `extra_flags` lets the tests build the portable path too (-mno-avx512f)."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: CPU decode attention uses the torch path")
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + _cpu_flags().encode() + platform.machine().encode()
                         + " ".join(extra_flags).encode())
    target = _cache_dir() / f"paged_attention_{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            cmd = [compiler, "-O3", "-march=native", *extra_flags, "-ffast-math", "-fopenmp",
                   "-shared", "-fPIC", str(_SOURCE), "-o", str(out), "-lm"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                logger.warning("building the CPU attention kernel failed, using the torch "
                               "path:\n%s", done.stderr[-2000:])
                return None
            os.replace(out, target)        # atomic: concurrent builders agree
    lib = ctypes.CDLL(str(target))
    fn = lib.folio_paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 4
                   + [ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_int])
    return lib


def load() -> Optional[ctypes.CDLL]:
    """The kernel library, or None when it cannot be built here."""
    global _lib, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _lib = _build()
            except OSError as e:
                logger.warning("CPU attention kernel unavailable (%s): using the torch path", e)
                _lib = None
        return _lib


def supports(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in _DTYPE_CODES and load() is not None


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float,
                 lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """q: [B, H, D]; kv_cache: [2, NB, BS, Hkv, D]; -> [B, H, D]."""
    q = q.contiguous()
    out = torch.empty_like(q)
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    tables = block_tables.contiguous()
    lens = context_lens.contiguous()
    failed = (lib or _lib).folio_paged_decode(
        q.data_ptr(), kv_cache.data_ptr(), out.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        q.shape[0], tables.shape[1], q.shape[1], num_kv_heads, head_dim, block_size,
        num_blocks, scale, _DTYPE_CODES[q.dtype], torch.get_num_threads())
    if failed:
        raise MemoryError("the CPU attention kernel could not allocate its scratch memory")
    return out
