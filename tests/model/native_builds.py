"""The builds of the native kernels a test runs here: this machine's own, the
AVX2 + FMA one (-mno-avx512f: what an AVX2-only CPU runs) and the portable C
one (-mno-avx512f -mno-avx2: no vector path). Each is tested where the CPU can
run it and skipped, with the reason, where it cannot."""

import platform

import pytest

from folio.kernels import native


def x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def cpu_has(*flags: str) -> bool:
    return all(f in native._cpu_flags().split() for f in flags)


def builds() -> list:
    """pytest params of the extra compiler flags: None is this machine's build.
    A build that is this machine's own here (the AVX2 one on an AVX2-only CPU)
    is not a second case: native covers it."""
    params = [pytest.param(None, id="native")]
    if not x86() or native.distinct_build(("-mno-avx512f",)):
        params.append(pytest.param(("-mno-avx512f",), id="avx2", marks=pytest.mark.skipif(
            not x86() or not cpu_has("avx2", "fma"),
            reason="the AVX2 build needs an x86-64 CPU with AVX2 and FMA")))
    params.append(pytest.param(("-mno-avx512f", "-mno-avx2"), id="portable",
                               marks=pytest.mark.skipif(
        not x86(), reason="the flags that turn the vector paths off are x86-specific")))
    return params


def library(flags):
    """The kernel library built with `flags` (None: the engine's own)."""
    lib = native.load() if flags is None else native._build(tuple(flags))
    if lib is None:
        pytest.skip("no C compiler here")
    return lib
