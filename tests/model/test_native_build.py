"""The kernel library is built once per machine and build, however many
threads and processes ask for it at once: the others wait for the builder
and load what it wrote (native._builder), and a build asked for ahead
(native.prebuild, what the test suite does at its start) is the one a later
caller gets. The compiler is replaced by a copy of this machine's library,
made to take a while: what is tested is who builds, not the compiler. (Under
scripts/pytest_as_avx2.py every build carries the simulation's flags too:
the tests read the flags a build ends with and the path it was written to.)"""

import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from folio.kernels import native

FLAGS = ("-DFOLIO_TEST_ONLY_KEY=1",)      # a build of its own, cached under its own name


def _wait_for_the_suites_prebuild():
    """The suite's own prebuild (tests/conftest.py) done before a test swaps
    what it calls: else its builds would land in the test's stand-ins."""
    for thread in threading.enumerate():
        if thread.name == "folio-kernels-prebuild":
            thread.join()


@pytest.fixture
def slow_compiler(tmp_path, monkeypatch):
    """native._compile replaced: a copy of the built library after 0.5 s; the
    calls it got (and from which thread)."""
    built = native.load()
    if built is None:
        pytest.skip("no C compiler here")
    source = built._name
    _wait_for_the_suites_prebuild()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def compile_(compiler, extra_flags, target, niced):
        calls.append((threading.current_thread().name, extra_flags, niced, target))
        time.sleep(0.5)
        shutil.copy(source, target)
        return True
    monkeypatch.setattr(native, "_compile", compile_)
    return source, calls


def test_a_build_asked_for_while_a_prebuild_runs_waits_for_it(slow_compiler):
    _, calls = slow_compiler
    ahead = native.prebuild([FLAGS])
    deadline = time.monotonic() + 30
    while not calls and time.monotonic() < deadline:    # the prebuild holds the lock, compiling
        time.sleep(0.01)
    lib = native._build(FLAGS)
    ahead.join()
    assert lib is not None and lib.folio_qlinear_available() in (0, 1, 2)
    assert len(calls) == 1
    thread, flags, niced, target = calls[0]
    assert thread == "folio-kernels-prebuild" and flags[-1:] == FLAGS and niced
    assert target.exists() and target.parent == native.library_path().parent
    native._build(FLAGS)                 # built: no compiler again
    assert len(calls) == 1


def test_the_machines_own_build_ahead_is_not_niced(slow_compiler):
    _, calls = slow_compiler
    native.prebuild([(), FLAGS]).join()
    assert [(flags[-1:] == FLAGS, niced) for _, flags, niced, _ in calls] == \
        [(False, False), (True, True)]


def test_a_process_building_the_library_holds_back_the_others(slow_compiler, tmp_path):
    """Another process (an engine core, a second pytest) building the same
    library: this one waits for it, then loads its library without compiling."""
    source, calls = slow_compiler
    native._build(FLAGS)                 # where this build goes: then not built again
    target = calls.pop()[3]
    target.unlink()
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import shutil, sys, time
        from pathlib import Path
        from folio.kernels import native
        with native._builder(Path({str(target)!r})):
            print("holding", flush=True)
            time.sleep(1.0)
            shutil.copy({source!r}, {str(target)!r})
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "holding"
        started = time.monotonic()
        lib = native._build(FLAGS)
        waited = time.monotonic() - started
    finally:
        child.wait(30)
    assert child.returncode == 0
    assert lib is not None and calls == [] and waited > 0.3


@pytest.mark.parametrize("vendor,locality", [("GenuineIntel", "2"), ("AuthenticAMD", None)])
def test_the_vendor_picks_where_the_int8_path_prefetches(monkeypatch, tmp_path, vendor, locality):
    """Intel's builds ask for the int8 path's codes into L2 (measured faster on
    a Xeon), others into L1 (as measured on AMD): the define on every unit's
    command, and the library cached under a name of its own."""
    _wait_for_the_suites_prebuild()
    commands = []

    def run_all(pending, jobs):
        commands.extend(pending)
        return "stopped: the command is what is tested"

    monkeypatch.setattr(native, "_run_all", run_all)
    monkeypatch.setattr(native, "_cpu_vendor", lambda: vendor)
    assert not native._compile("cc", FLAGS, tmp_path / "lib.so", niced=False)
    defines = [[f for f in c if f.startswith("-DFOLIO_QL_PREFETCH_LOCALITY")] for c in commands]
    assert commands and all(d == ([f"-DFOLIO_QL_PREFETCH_LOCALITY={locality}"] if locality
                                  else []) for d in defines)
    # the flags asked for come after the vendor's, so a build can override it
    assert all(c.index(FLAGS[0]) > c.index(d[0] if d else "-march=native")
               for c, d in zip(commands, defines))
    named = native.library_path(FLAGS)
    monkeypatch.setattr(native, "_cpu_vendor",
                        lambda: "AuthenticAMD" if vendor == "GenuineIntel" else "GenuineIntel")
    assert native.library_path(FLAGS) != named


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
def test_qlinear_prefetches_into_the_cache_the_define_names():
    """qlinear.c's int8 path passes FOLIO_QL_PREFETCH_LOCALITY to its
    prefetches (preprocessed only), the float path keeps locality 3."""
    def prefetches(*defines):
        out = subprocess.run(["cc", "-E", "-P", "-march=native", *defines, "-DFOLIO_QLINEAR_PART=0",
                              str(native._DIR / "qlinear.c")],
                             capture_output=True, text=True, check=True).stdout
        return sorted(set(re.findall(r"__builtin_prefetch\(ahead[^;]*;", out)))
    assert prefetches("-DFOLIO_QL_PREFETCH_LOCALITY=2") == [
        "__builtin_prefetch(ahead + 64, 0, 2);", "__builtin_prefetch(ahead + 64, 0, 3);",
        "__builtin_prefetch(ahead, 0, 2);", "__builtin_prefetch(ahead, 0, 3);"]
    assert prefetches() == ["__builtin_prefetch(ahead + 64, 0, 3);",
                            "__builtin_prefetch(ahead, 0, 3);"]
