"""`folio env`: what this machine is and which kernel each layer will use.

Every answer is asked of the same function the engine asks (the dtype choice,
`native.supports` / `fuses` / `packs_linear`, `pack_onednn`), on small probe
tensors, so the report cannot disagree with what a run does. Imports torch:
call it from commands, not at import time of the CLI.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from typing import Optional

FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                     "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_info() -> tuple[str, list[str]]:
    """(the CPU model, its flags) from /proc/cpuinfo."""
    model, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = value.split()
    except OSError:
        pass
    return model, flags


def _compiler() -> Optional[str]:
    import os
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return cc
    return out.stdout.splitlines()[0] if out.stdout else cc


def kernel_choices(dtype: str) -> dict[str, str]:
    """Per layer, the kernel a CPU run in `dtype` uses, and why."""
    import torch

    from folio.kernels import native
    from folio.model.layers.linear import pack_onednn
    from folio.worker.device import split_cpu_bf16

    asked, (dtype, store) = dtype, split_cpu_bf16(dtype, "cpu")
    t = torch.zeros(16, 16, dtype=getattr(torch, dtype))
    lib = native.load()
    why_no_lib = "no native library (no C compiler, or its build failed)"
    if native.supports(t):
        width = lib.folio_attention_vector_width()
        attention = "native paged attention, " + (
            {16: "AVX-512", 8: "AVX2"}.get(width, f"{width}-float") + " tiles, online softmax"
            if width else "portable C")
    else:
        attention = f"torch (gather + SDPA): {why_no_lib if lib is None else dtype}"
    split = store is not None and native.packs_linear_bf16w(t)
    fused = (f"native fused kernels ({dtype})" if native.fuses(t) else
             "native fused kernels (fp32) inside the one-call decoder; torch ops in the "
             "modules" if split else
             "torch ops (fp32 stays bit-exact with the reference)" if lib is not None
             else f"torch ops: {why_no_lib}")
    if split:
        linear = (f"AVX2 kernel: fp32 arithmetic on {store}-stored weights ({asked} on a CPU "
                  "without native bf16)")
    elif native.packs_linear(t):
        linear = "native bf16 kernel (AVX512-BF16" + (
            "; many rows on the AMX tiles)" if native.has_amx_linear() else ")")
    elif pack_onednn(t) is not None:
        linear = "oneDNN packed weights" + (" (AMX)" if "amx_bf16" in cpu_info()[1] else "")
    elif dtype == "bfloat16":
        linear = "F.linear on plain weights (oneDNN packs no bf16 weight on this CPU)"
    else:
        linear = f"F.linear (MKL, {dtype})"
    decoder = ("one native call for all layers (tensor-parallel size 1)"
               if split or (native.packs_linear(t) and native.fuses(t))
               else "one torch module per layer (needs a native linear kernel: bf16 on "
                    "AVX512-BF16, or bf16-stored weights on AVX2)")
    greedy = "native argmax pass" if native.supports(t) else "torch argmax + log_softmax"
    x = torch.zeros(1, dtype=getattr(torch, dtype))
    if native.runs_qlinear(x):
        lib = native.load()
        isa = "AVX-512" if lib.folio_qlinear_available() == 2 else "AVX2"
        vnni = "avx512_vnni" if isa == "AVX-512" else "avx_vnni"
        dot = "vpdpbusd" if vnni in cpu_info()[1] else "vpmaddubsw"
        above = ("x as int16 per block of 32" if dtype == "bfloat16" else "fp32 arithmetic")
        quantized = (f"native {isa} kernel on the codes: x as int8 per block of 32 ({dot})"
                     + _int8_rows(lib, above) +
                     "--activation-quantization none: "
                     + ("int16" if dtype == "bfloat16" else "fp32 arithmetic")
                     + " throughout; one native call for all layers")
    else:
        quantized = "dequantized per call, then F.linear" + (
            f": {why_no_lib}" if lib is None else " (the kernel needs AVX2, FMA and F16C)")
    return {"attention": attention, "element-wise (norm, rotary, SiLU)": fused,
            "linear": linear, "quantized linear (4/8-bit codes)": quantized,
            "decoder layers": decoder, "greedy sampling": greedy}


def _int8_rows(lib, above: str) -> str:
    """Where the engine's int8 path stops (qlinear.c's folio_qlinear_int8_rows)."""
    every = 0x7fffffff
    four, eight = lib.folio_qlinear_int8_rows(4), lib.folio_qlinear_int8_rows(8)
    if four == eight == every:
        return " at every row count; "
    rows = lambda n: "every row count" if n == every else f"up to {n} rows"
    return f" at {rows(four)} (4-bit codes) / {rows(eight)} (8-bit), {above} above; "


def collect() -> dict:
    import torch

    from folio import __version__
    from folio.worker.device import cpu_has_native_bf16, resolve_device, resolve_dtype
    model, flags = cpu_info()
    device = resolve_device(None)
    auto = resolve_dtype("auto", device)
    report = {
        "folio": __version__, "python": platform.python_version(), "torch": torch.__version__,
        "compiler": _compiler(), "cpu": model, "threads": _threads(),
        "cpu flags": [f for f in FLAGS_OF_INTEREST if f in flags],
        "native bf16": cpu_has_native_bf16(), "device": device, "dtype auto": auto,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "kernels": {d: kernel_choices(d) for d in ("float32", "bfloat16")},
    }
    return report


def _threads() -> str:
    from folio.worker.cpu_threads import default_threads
    threads, why = default_threads()
    return f"{threads} ({why})"


def format_report(report: dict, dtype: Optional[str] = None) -> str:
    """Readable lines; `dtype` limits the kernel table to one dtype."""
    lines = [f"{k}: {', '.join(v) if isinstance(v, list) else v}"
             for k, v in report.items() if k != "kernels"]
    for d, choices in report["kernels"].items():
        if dtype is None or d == dtype:
            lines.append(f"kernels for {d}:")
            lines.extend(f"  {layer}: {kernel}" for layer, kernel in choices.items())
    return "\n".join(lines)
