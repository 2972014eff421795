"""vLLM's command line where users bring it (issue 52): several
--served-model-name aliases, a model served by its path answering to its
own name, --generation-config auto|vllm|PATH, --tokenizer, --trust-remote-code,
and every bad value found while the command line is read exiting 2."""

import json
import shutil
import subprocess
import sys

import pytest

from tests.server.conftest import ServerProcess, http, tiny_server_args
from tests.test_tokenizer import _default_gguf


def _models(srv) -> list[str]:
    return [m["id"] for m in http("GET", srv.url + "/v1/models")[2]["data"]]


def _complete(srv, model, **extra):
    return http("POST", srv.url + "/v1/completions",
                {"model": model, "prompt": "the cat", "ignore_eos": True, **extra})


def test_aliases_tokenizer_and_trust_remote_code(tiny_model):
    args = [a for a in tiny_server_args(tiny_model) if a not in ("--served-model-name", "tiny")]
    srv = ServerProcess(args + ["--served-model-name", "main", "alias", "--tokenizer",
                                tiny_model, "--trust-remote-code"])
    try:
        assert _models(srv) == ["main", "alias"]
        for name in ("main", "alias"):
            status, _, out = _complete(srv, name, max_tokens=2)
            assert status == 200 and out["model"] == name
        assert _complete(srv, "tiny", max_tokens=2)[0] == 404
        assert "--trust-remote-code: accepted and unused" in srv.output()
    finally:
        srv.stop()


def test_the_default_models_file_answers_to_its_name():
    path = _default_gguf()
    srv = ServerProcess([path, "--num-kv-blocks", "64", "--max-model-len", "1024",
                         "--uvicorn-log-level", "warning"])
    try:
        names = _models(srv)
        base = path.rsplit("/", 1)[-1]
        assert names[0] == base and "SmolLM2-135M-Instruct" in names
        assert base[:-len(".gguf")] in names
        status, _, out = _complete(srv, "SmolLM2-135M-Instruct", max_tokens=2)
        assert status == 200 and out["model"] == "SmolLM2-135M-Instruct"
    finally:
        srv.stop()


@pytest.mark.parametrize("mode", ["auto", "vllm", "path"])
def test_generation_config_sets_the_defaults_a_request_leaves_unset(tiny_model, tmp_path, mode):
    """A folder whose generation_config.json says max_new_tokens 3: a chat
    request without max_tokens gets 3 (auto, or PATH naming another folder);
    with vllm, what the context has left (OpenAI's chat default); a request's
    own max_tokens wins."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    gen = json.loads((model / "generation_config.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    target = other if mode == "path" else model
    (target / "generation_config.json").write_text(json.dumps({**gen, "max_new_tokens": 3}))
    flag = {"auto": "auto", "vllm": "vllm", "path": str(other)}[mode]
    srv = ServerProcess(tiny_server_args(str(model)) + ["--generation-config", flag])
    def chat(**extra):
        return http("POST", srv.url + "/v1/chat/completions",
                    {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                     "ignore_eos": True, **extra})
    try:
        status, _, out = chat()
        assert status == 200
        want = 3 if mode != "vllm" else 256 - out["usage"]["prompt_tokens"]
        assert out["usage"]["completion_tokens"] == want
        status, _, out = chat(max_tokens=5)
        assert out["usage"]["completion_tokens"] == 5
    finally:
        srv.stop()


@pytest.mark.parametrize("flags", [
    ["--speculative-config", '{"method": "nope"}'],
    ["--speculative-config", "{"],
    ["--tokenizer", "/no/such/folder"],
    ["--generation-config", "/no/such/folder"],
    ["--kv-cache-dtype", "fp8_e3m4"],
    ["--served-model-name"],
])
def test_a_bad_value_exits_2_while_the_command_line_is_read(flags):
    done = subprocess.run([sys.executable, "-m", "folio.cli", "serve", *flags],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "error: argument" in done.stderr


def test_defaults_fill_only_what_a_request_leaves_unset():
    from folio.server.protocol import ChatCompletionRequest
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], temperature=0.0,
                                top_p=None)
    p = req.sampling_params(8, None, defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k) == (0.0, 0.9, 20)
    from folio import SamplingParams
    p, plain = req.sampling_params(8, None), SamplingParams()
    assert (p.temperature, p.top_p, p.top_k) == (0.0, plain.top_p, plain.top_k)


def test_vllms_fp8_names():
    from folio.config import kv_cache_dtype_named
    assert kv_cache_dtype_named("fp8_e4m3") == "fp8" and kv_cache_dtype_named("int8") == "int8"
    assert kv_cache_dtype_named("fp8_e5m2") == "fp8_e5m2"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_cache_dtype_named("fp8_e3m4")
