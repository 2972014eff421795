"""`folio bench throughput --baseline llama-cpp`: llama.cpp's llama-server on
the same GGUF file, fed the same token ids.

The real binary is run where one is found (on PATH, or built in this checkout
by scripts/install_llama_cpp.sh, a few minutes that `make test` does not
spend); the client side (slots, what is asked, counting, a server that fails)
is tested everywhere against tests/bench/fake_llama_server.py, a stand-in
that says it is one."""

import json
import sys
from pathlib import Path

import pytest

from folio.cli import main
from tests.utils import default_gguf_path, make_tiny_model, write_tiny_gguf

FAKE = Path(__file__).with_name("fake_llama_server.py")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama-cpp")
    return write_tiny_gguf(make_tiny_model(d / "hf"), d / "tiny.gguf", "Q8_0")


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    """An executable that runs the stand-in; returns (path, log of what it saw)."""
    exe = tmp_path / "llama-server"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    exe.chmod(0o755)
    log = tmp_path / "seen.json"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    return str(exe), log


def bench(capsys, model, *flags):
    rc = main(["bench", "throughput", "--model", model, "--dtype", "float32", "--json", *flags])
    out = capsys.readouterr()
    return rc, (json.loads(out.out.strip().splitlines()[-1]) if rc == 0 else out.err)


def test_every_request_goes_to_the_server_as_the_same_tokens(tiny_gguf, fake_server, capsys):
    exe, log = fake_server
    rc, result = bench(capsys, tiny_gguf, "--num-prompts", "6", "--input-len", "4:40",
                       "--output-len", "3:9", "--baseline", "llama-cpp",
                       "--baseline-batch", "2", "--llama-server", exe)
    assert rc == 0
    (b,) = result["baselines"]
    assert b["name"] == "llama-cpp" and b["requests"] == 6
    assert b["output_tokens"] == result["output_tokens"]     # EOS ignored on both sides
    seen = json.loads(log.read_text())
    warm, *timed = seen["requests"]
    assert warm["n_predict"] == 4 and len(timed) == 6
    assert sum(len(r["prompt"]) for r in timed) == result["prompt_tokens"]
    assert sum(r["n_predict"] for r in timed) == result["output_tokens"]
    assert all(isinstance(t, int) for r in timed for t in r["prompt"])   # token ids, no BOS
    assert all(r["ignore_eos"] and not r["cache_prompt"] and r["temperature"] == 0
               and not r["stream"] for r in timed)
    assert seen["max_in_flight"] == 2                       # one request per slot
    argv = seen["argv"]
    flag = dict(zip(argv[::2], argv[1::2]))
    assert flag["-m"] == tiny_gguf and flag["-np"] == "2" and flag["-t"] == str(result["threads"])
    longest = max(len(r["prompt"]) + r["n_predict"] for r in timed)
    assert int(flag["-c"]) >= 2 * (longest + 1)             # every slot holds its longest request


@pytest.mark.parametrize("mode, error", [
    ("short", "returned 3 tokens for a request of 4"),              # an error, not a rate
    ("die", "(?s)exited with 3 before.*failed to load model"),      # its log shown
])
def test_a_failing_server_is_an_error(tiny_gguf, fake_server, capsys, monkeypatch, mode, error):
    exe, _ = fake_server
    monkeypatch.setenv("FAKE_LLAMA_MODE", mode)
    with pytest.raises(RuntimeError, match=error):
        bench(capsys, tiny_gguf, "--num-prompts", "2", "--output-len", "4",
              "--baseline", "llama-cpp", "--llama-server", exe)


def test_a_model_that_is_not_gguf_is_refused_before_anything_runs(tmp_path, capsys):
    folder = make_tiny_model(tmp_path / "hf")
    rc, err = bench(capsys, folder, "--baseline", "llama-cpp", "--llama-server", sys.executable)
    assert rc == 1 and "llama.cpp reads GGUF only" in err


def test_a_missing_binary_is_refused(tiny_gguf, tmp_path, capsys):
    rc, err = bench(capsys, tiny_gguf, "--baseline", "llama-cpp",
                    "--llama-server", str(tmp_path / "nothing"))
    assert rc == 1 and "not an executable file" in err


def test_the_real_llama_server_on_the_default_gguf(capsys):
    from folio.bench.llama_cpp import find_llama_server
    try:
        exe = find_llama_server()
    except ValueError as e:
        pytest.skip(f"no llama-server on this machine ({e})")
    rc, result = bench(capsys, default_gguf_path(), "--num-prompts", "3", "--input-len", "8:24",
                       "--output-len", "5", "--baseline", "llama-cpp", "--baseline-batch", "2",
                       "--llama-server", exe)
    assert rc == 0
    (b,) = result["baselines"]
    assert b["output_tokens"] == 15 and b["output_tokens_per_s"] > 0
