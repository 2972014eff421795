import io

import pytest

from folio import LLM, SamplingParams
from folio.cli import main
from tests.utils import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("cli"))


def test_generate_prints_the_greedy_completion(tiny, capsys):
    rc = main(["generate", "--model", tiny, "--prompt", "Hello world", "--max-tokens", "6",
               "--ignore-eos", "--dtype", "float32", "--num-kv-blocks", "16"])
    expected = LLM(tiny, dtype="float32", num_kv_blocks=16).generate(
        "Hello world", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert rc == 0
    assert capsys.readouterr().out == expected.outputs[0].text + "\n"


def test_chat_keeps_history_and_exits(tiny, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nand again\n/exit\n"))
    rc = main(["chat", "--model", tiny, "--max-tokens", "3", "--ignore-eos", "--dtype",
               "float32", "--num-kv-blocks", "16"])
    assert rc == 0
    assert capsys.readouterr().out.count("\n") == 2     # one line per answer


def test_bad_argument_is_an_error_not_a_traceback(tiny, capsys):
    rc = main(["generate", "--model", tiny, "--prompt", "x", "--top-p", "2"])
    assert rc == 2 and "top_p" in capsys.readouterr().err
