"""build_config refuses a bad value from the checkpoint's config (or a GGUF's
metadata) and the flags alone: before the tokenizer, the executor or any
weight loads, as a ValueError from LLM(...) and one `folio: error:` line with
exit status 1 from the CLI."""

import re
import subprocess
import sys

import pytest

from folio import LLM
from folio.cli import main
from folio.engine import llm_engine
from folio.worker import model_runner
from tests.server.conftest import free_port
from tests.utils import make_tiny_model

FLOAT16 = "float16 runs on CUDA only; on the CPU use bfloat16 or float32"
TOO_LONG = ("max_model_len=100000 must be between 1 and the model's "
            "max_position_embeddings (8192)")
AWQ = ("--quantization awq reads the tensors of awq checkpoints, which a GGUF file does "
       "not hold; a GGUF runs as gguf (its Q4_0/Q4_1/Q8_0 blocks as stored, the default), "
       "none (dequantized to float at load) or fp8 / int4 / int8 (its dequantized weights "
       "requantized at load)")


@pytest.fixture
def nothing_loads(monkeypatch):
    """Any step past the config fails the test."""
    def started(*args, **kwargs):
        raise AssertionError("the engine started loading the model")
    monkeypatch.setattr(llm_engine, "make_executor", started)
    monkeypatch.setattr(llm_engine, "get_tokenizer", started)
    monkeypatch.setattr(model_runner, "iter_weights", started)


@pytest.mark.parametrize("kwargs, message", [
    (dict(device="cpu", dtype="float16"), FLOAT16),
    (dict(device="cpu", dtype="fp16"), FLOAT16),
    (dict(max_model_len=100000), TOO_LONG),
])
def test_llm_refuses_before_loading(kwargs, message, nothing_loads):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        LLM(**kwargs)


def test_a_length_above_a_folders_config_is_refused_before_loading(tmp_path, nothing_loads):
    folder = make_tiny_model(tmp_path, max_position_embeddings=128)
    with pytest.raises(ValueError, match=r"max_model_len=129 must be between 1 and the "
                                         r"model's max_position_embeddings \(128\)"):
        LLM(folder, max_model_len=129)


def _error_lines(capsys):
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("folio")]


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
@pytest.mark.parametrize("flags, message", [
    (["--device", "cpu", "--dtype", "float16"], FLOAT16),
    (["--max-model-len", "100000"], TOO_LONG),
    (["-q", "awq"], AWQ),
])
def test_the_cli_says_one_line_and_exits_1_before_loading(command, flags, message, capsys,
                                                          monkeypatch, nothing_loads):
    import uvicorn

    def serving(*args, **kwargs):
        raise AssertionError("the server started")
    monkeypatch.setattr(uvicorn, "Server", serving)
    assert main(command + flags) == 1
    assert _error_lines(capsys) == [f"folio: error: {message}"]


def test_serve_refuses_before_the_server_starts_as_a_process():
    """The real process: one line on stderr, exit 1, no uvicorn line (its port
    is never bound)."""
    done = subprocess.run([sys.executable, "-m", "folio.cli", "serve", "--port", str(free_port()),
                           "--device", "cpu", "--dtype", "float16"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == f"folio: error: {FLOAT16}"
    assert "Uvicorn" not in done.stderr and "folio: error" not in done.stderr.splitlines()[0:-1]


# --------------------------------------------------------------------------- --quantization


def test_an_unknown_method_is_named_with_the_known_ones(tmp_path, nothing_loads, capsys):
    for model in (None, make_tiny_model(tmp_path)):
        with pytest.raises(ValueError) as info:
            LLM(model, quantization="x")
        message = str(info.value)
        assert message.startswith("unknown quantization method 'x'; known: ")
        known = message.split("known: ")[1].split(", ")
        assert {"none", "gguf", "gptq", "awq", "compressed-tensors", "int8", "int4"} <= set(known)
    assert main(["generate", "--prompt", "hi", "-q", "x"]) == 1
    lines = _error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("folio: error: unknown quantization "
                                                   "method 'x'; known: ")


@pytest.mark.parametrize("method", ["awq", "gptq", "compressed-tensors"])
def test_a_checkpoint_format_on_a_gguf_says_what_a_gguf_runs_with(method, nothing_loads):
    with pytest.raises(ValueError) as info:
        LLM(quantization=method)
    assert str(info.value) == AWQ.replace("awq", method)


def test_the_method_name_is_case_blind(nothing_loads):
    with pytest.raises(ValueError, match="^--quantization awq reads"):
        LLM(quantization="AWQ")


def test_gguf_on_a_folder_is_refused(tmp_path, nothing_loads):
    """-q gguf on a float HF folder ran it as plain weights, saying nothing."""
    folder = make_tiny_model(tmp_path)
    with pytest.raises(ValueError) as info:
        LLM(folder, quantization="gguf")
    assert str(info.value) == (f"--quantization gguf runs a GGUF file's blocks; {folder} is a "
                               "Hugging Face folder (weights: float): drop the flag, or give "
                               "int8 / int4 / fp8 to quantize its float weights at load")
