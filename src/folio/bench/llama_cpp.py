"""The llama.cpp baseline of `folio bench throughput`: its `llama-server` on
the same GGUF file, fed the same requests as token ids.

The server runs with `--baseline-batch` slots (its continuous batching) and
the benchmark's thread count; every request is offered at once, at most one
per slot in flight, each asking for exactly its `max_tokens` (EOS ignored,
greedy, no prompt cache: each prompt is computed, as Folio's timed runs
compute theirs). A token-id prompt gets no BOS added, so both engines read
the same tokens. `scripts/install_llama_cpp.sh` builds the binary from a
pinned llama.cpp in a few minutes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from folio.bench.datasets import BenchRequest
from folio.worker.multiproc import free_local_port

INSTALL_HINT = ("build one with scripts/install_llama_cpp.sh in the Folio checkout, or "
                "give its path with --llama-server")


def find_llama_server(path: str | None = None) -> str:
    """The `llama-server` to run: `path`, else one on PATH, else the one
    scripts/install_llama_cpp.sh builds in this checkout (its native build, else
    its avx512 one)."""
    if path:
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise ValueError(f"--llama-server {path}: not an executable file")
        return path
    found = shutil.which("llama-server")
    if found:
        return found
    for isa in ("native", "avx512"):        # avx512: the build without AMX
        built = Path(__file__).resolve().parents[3] / "build" / "llama.cpp" / isa / "bin" / \
            "llama-server"
        if built.is_file():
            return str(built)
    raise ValueError(f"the llama-cpp baseline needs llama.cpp's llama-server: {INSTALL_HINT}")


def check_gguf(model_format: str, path: str) -> None:
    if model_format != "gguf":
        raise ValueError(f"the llama-cpp baseline runs the same GGUF file, and {path} is not "
                         "one (llama.cpp reads GGUF only)")


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


class LlamaServer:
    """One llama-server process on a free local port, stopped on exit."""

    def __init__(self, binary: str, gguf: str, slots: int, ctx_per_slot: int, threads: int,
                 startup_timeout: float = 300.0, extra_args: tuple[str, ...] = ()):
        self.port = free_local_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile()     # noqa: SIM115 - closed by close()
        self.cmd = [binary, "-m", gguf, "-t", str(threads), "-tb", str(threads),
                    "-np", str(slots), "-c", str(slots * ctx_per_slot),
                    "--host", "127.0.0.1", "--port", str(self.port), "--no-webui",
                    *extra_args]
        self._proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.close()
            raise

    def _log_tail(self, n: int = 2000) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-n:]

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self._proc.returncode} before "
                                   f"it was ready:\n{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"llama-server was not ready in {timeout:.0f} s:\n{self._log_tail()}")

    def complete(self, token_ids: list[int], max_tokens: int, timeout: float = 3600.0,
                 result: dict | None = None) -> int:
        """Output tokens of one greedy completion of exactly `max_tokens`
        (`result`, if given, gets the server's whole answer)."""
        out = _post(f"{self.url}/completion",
                    {"prompt": token_ids, "n_predict": max_tokens, "ignore_eos": True,
                     "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                     "stream": False}, timeout)
        if result is not None:
            result.update(out)
        n = out.get("tokens_predicted")
        if n != max_tokens:
            raise RuntimeError(f"llama-server returned {n} tokens for a request of {max_tokens} "
                               f"(truncated: {out.get('truncated')})")
        return n

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_llama_cpp(binary: str, gguf: str, requests: list[BenchRequest], slots: int,
                  threads: int, progress=None) -> tuple[int, float]:
    """(output tokens, seconds) of llama-server with `slots` slots on the requests."""
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    ctx = -(-(longest + 1) // 256) * 256       # per slot, rounded up to whole 256s
    with LlamaServer(binary, gguf, slots, ctx, threads) as server:
        server.complete([1] * 16, 4)            # warm-up, as Folio's run has

        def one(r: BenchRequest) -> int:
            n = server.complete(list(r.prompt_token_ids), r.max_tokens)
            if progress:
                progress(1)
            return n

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=slots) as pool:
            done = sum(pool.map(one, requests))
        return done, time.perf_counter() - t0
