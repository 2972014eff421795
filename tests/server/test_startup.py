"""A `folio serve` that cannot serve ends: one line saying why, a non-zero exit,
whether the model fails to load or the engine dies later.

Orchestrators (systemd, Docker, Kubernetes) restart or report a process that
exits; one that keeps answering 503 forever looks merely slow.
"""

import shutil
import subprocess
import sys
import time

from tests.server.conftest import ServerProcess, free_port, http


def serve(*args: str, timeout: float = 120.0) -> tuple[int, str, float]:
    """(exit code, everything printed, seconds it ran) of a serve that should fail."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "folio.cli", "serve", "--port", str(free_port()),
                           "--uvicorn-log-level", "warning", *args],
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def the_error(output: str) -> str:
    """The one error line; nothing else in the output looks like a failure."""
    lines = [ln for ln in output.splitlines() if ln.startswith("folio: error:")]
    assert len(lines) == 1, output
    assert "Traceback" not in output and "ERROR" not in output, output
    return lines[0]


def test_a_model_path_that_does_not_exist(tmp_path):
    code, out, _ = serve(str(tmp_path / "nope"))
    assert code == 1
    line = the_error(out)
    # found while the config is built, before the server starts
    assert line.startswith("folio: error: model ")
    assert "nope" in line and "not found" in line


def test_a_broken_tokenizer_json(tiny_model, tmp_path):
    model = shutil.copytree(tiny_model, tmp_path / "broken")
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    code, out, _ = serve(str(model), "--dtype", "float32")
    assert code == 1
    assert the_error(out).startswith("folio: error: the model failed to load: cannot read "
                                     "the tokenizer ")


def test_a_kv_cache_too_small_for_one_sequence_says_how_much_is_needed(tiny_model):
    # 256 positions in 16-token blocks need 16 blocks; 15 cannot hold one full sequence.
    code, out, _ = serve(tiny_model, "--dtype", "float32", "--num-kv-blocks", "15")
    assert code == 1
    line = the_error(out)
    assert "KV cache is too small" in line and "240 tokens" in line
    assert "max_model_len=256" in line and "--num-kv-blocks 16" in line
    # the bytes it names are enough: that budget starts the server
    need = line.split("--kv-cache-memory-bytes ")[1].split()[0]
    srv = ServerProcess([tiny_model, "--dtype", "float32", "--kv-cache-memory-bytes", need,
                         "--uvicorn-log-level", "warning"])
    try:
        assert http("GET", srv.url + "/health")[0] == 200
    finally:
        srv.stop()


def test_a_broken_chat_template_fails_before_loading(tiny_model):
    code, out, seconds = serve(tiny_model, "--chat-template", "{% for m in messages %}{{ m }")
    assert code != 0 and seconds < 30
    line = the_error(out)
    assert line.startswith("folio: error: --chat-template: the chat template is not valid Jinja")


def test_a_chat_template_file_that_does_not_exist(tiny_model, tmp_path):
    code, out, _ = serve(tiny_model, "--chat-template", str(tmp_path / "chat.jinja"))
    assert code != 0
    assert "no such file" in the_error(out)


def test_a_chat_template_file_is_used(tiny_model, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    srv = ServerProcess([tiny_model, "--dtype", "float32", "--chat-template", str(template),
                         "--uvicorn-log-level", "warning"])
    try:
        chat = http("POST", srv.url + "/tokenize",
                    {"messages": [{"role": "user", "content": "a"}, {"role": "user",
                                                                     "content": "b"}]})
        text = http("POST", srv.url + "/tokenize", {"prompt": "[a][b]"})
    finally:
        srv.stop()
    assert chat[0] == 200 and chat[2]["tokens"] == text[2]["tokens"]
    # The start-up log carries `folio env`'s summary for the dtype served.
    log = srv.output()
    assert "environment (folio env):" in log and "kernels for float32:" in log
    assert "kernels for bfloat16:" not in log


DIES_AT_FIRST_STEP = """
import sys
from folio.engine.llm_engine import LLMEngine
def step(self):
    raise RuntimeError("injected")
LLMEngine.step = step
from folio.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_engine_that_dies_later_ends_the_process(tiny_model, tmp_path):
    script = tmp_path / "dies.py"
    script.write_text(DIES_AT_FIRST_STEP)
    port = free_port()
    # the engine in a thread of the server (the patch above is this process's;
    # the core's own process dying: test_engine_process.py, and a failure
    # inside it: test_tensor_parallel_server.py)
    proc = subprocess.Popen([sys.executable, str(script), "serve", tiny_model, "--dtype",
                             "float32", "--port", str(port), "--uvicorn-log-level", "warning",
                             "--no-engine-process"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end and proc.poll() is None:
            try:
                if http("GET", url + "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
        status, _, err = http("POST", url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 503 and "injected" in err["error"]["message"]   # the client is told
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1
    assert out.splitlines()[-1] == "folio: error: the engine stopped: RuntimeError('injected')"
