import io
import json
import shutil
import socket
import subprocess
import sys
import time

import pytest

from folio import LLM, SamplingParams, __version__
from folio.cli import build_parser, main, sampling_params
from folio.generation_config import CHAT_DEFAULTS, chat_defaults, read_generation_config
from tests.utils import make_tiny_model

ENGINE = ["--dtype", "float32", "--num-kv-blocks", "40"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("cli"))


def folio(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "folio.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def error_lines(stderr: str) -> list[str]:
    # INFO log lines may precede the error while a model loads.
    return [line for line in stderr.splitlines() if not line.startswith("INFO ")]


# --------------------------------------------------------------------------- generate


def test_generate_prints_the_greedy_completion(tiny, capsys):
    rc = main(["generate", "--model", tiny, "--prompt", "Hello world", "--max-tokens", "6",
               "--ignore-eos", *ENGINE])
    expected = LLM(tiny, dtype="float32", num_kv_blocks=40).generate(
        "Hello world", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert rc == 0
    assert capsys.readouterr().out == expected.outputs[0].text + "\n"


# --------------------------------------------------------------------------- chat, in-process


def run_chat(monkeypatch, capsys, lines: str, *args: str):
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    rc = main(["chat", *args])
    return rc, capsys.readouterr()


def test_chat_keeps_both_turns_in_the_history(tiny, capsys, monkeypatch):
    rc, out = run_chat(monkeypatch, capsys, "hi\nand again\n/history\n/exit\n", "--model", tiny,
                       "--max-tokens", "3", "--ignore-eos", "--temperature", "0", *ENGINE)
    assert rc == 0
    history = out.out[out.out.index("[user] hi"):]
    assert history.count("[user]") == 2 and history.count("[assistant]") == 2
    assert "[user] and again" in history
    assert out.err.count("[reply cut at --max-tokens 3]") == 2


def test_chat_survives_a_conversation_longer_than_the_context(tiny, capsys, monkeypatch):
    # The first reply fills the 64 positions, the second message no longer fits.
    rc, out = run_chat(monkeypatch, capsys, "hi\nmore\n/history\n/reset\nhi\n/exit\n",
                       "--model", tiny, "--max-model-len", "64", "--ignore-eos", *ENGINE)
    assert rc == 0
    assert "[reply cut: the conversation fills the context; /reset starts over]" in out.err
    assert "max_model_len is 64" in out.err and "(/reset starts over)" in out.err
    assert "[user] more" not in out.out           # the message that did not fit is dropped
    assert out.err.count("[reply cut") == 2       # and after /reset the chat goes on


def test_an_unknown_command_is_refused_and_never_sent_to_the_model(tiny, capsys, monkeypatch):
    rc, out = run_chat(monkeypatch, capsys, "/bogus\n  /histroy all\n/history\n//bogus\n"
                       "/history\n/exit\n", "--model", tiny, "--max-tokens", "2",
                       "--ignore-eos", "--temperature", "0", *ENGINE)
    assert rc == 0
    usage = "; commands: /history, /reset, /exit, /quit (// sends a message that starts with /)"
    assert f"unknown command /bogus{usage}\n" in out.err
    assert f"unknown command /histroy{usage}\n" in out.err
    before, after = out.out.split("(no messages yet)\n")    # the first /history: nothing sent
    assert "[user]" not in before
    assert after.count("[user]") == 1 and "[user] /bogus\n" in after   # // sent it, from its /
    assert after.count("[assistant]") == 1


def test_chat_without_a_template_fails_before_the_prompt(tmp_path, capsys, monkeypatch):
    path = make_tiny_model(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps(config))
    rc, out = run_chat(monkeypatch, capsys, "hi\n", "--model", path, *ENGINE)
    assert rc == 1 and "no chat template" in out.err


# --------------------------------------------------------------------------- sampling defaults


def write_generation_config(folder, **values) -> str:
    folder.mkdir(exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **values}))
    return str(folder)


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_chat_takes_the_checkpoints_sampling_and_flags_win(tmp_path):
    model = write_generation_config(tmp_path, do_sample=True, temperature=0.6, top_p=0.95,
                                    top_k=20, repetition_penalty=1.1, max_new_tokens=100)
    params = sampling_params(parse("chat", "--model", model, "--temperature", "0.2"),
                             chat_defaults(model))
    assert (params.temperature, params.top_p, params.top_k) == (0.2, 0.95, 20)
    assert (params.repetition_penalty, params.max_tokens) == (1.1, 100)


def test_chat_without_a_generation_config_samples_with_folios_defaults():
    params = sampling_params(parse("chat"), chat_defaults(None))     # the default GGUF
    assert (params.temperature, params.top_p, params.max_tokens) == (0.7, 0.9, 512)
    assert CHAT_DEFAULTS == {"temperature": 0.7, "top_p": 0.9, "max_tokens": 512}


def test_generation_config_do_sample_false_means_greedy(tmp_path):
    model = write_generation_config(tmp_path, do_sample=False, temperature=0.9)
    assert read_generation_config(model) == {"temperature": 0.0}


def test_generation_config_without_sampling_fields_keeps_folios(tmp_path):
    model = write_generation_config(tmp_path)      # what make_tiny_model writes
    assert chat_defaults(model) == CHAT_DEFAULTS


def test_a_bad_generation_config_names_the_file(tmp_path):
    model = write_generation_config(tmp_path, top_p=0)
    with pytest.raises(ValueError, match=r"generation_config.json: top_p must be in \(0, 1\]"):
        read_generation_config(model)


def test_generate_stays_greedy_whatever_the_checkpoint_says(tmp_path):
    write_generation_config(tmp_path, temperature=0.6)
    params = sampling_params(parse("generate", "--prompt", "x", "--model", str(tmp_path)), {})
    assert (params.temperature, params.max_tokens) == (0.0, 64)


def test_sampling_seed_is_the_requests_and_seed_the_engines():
    args = parse("generate", "--prompt", "x", "--seed", "3", "--sampling-seed", "7")
    assert sampling_params(args, {}).seed == 7 and args.seed == 3


# --------------------------------------------------------------------------- flags


def test_allowed_origins_takes_one_value_and_leaves_the_model_alone():
    args = parse("serve", "--allowed-origins", "http://a", "/my/model")
    assert args.model_pos == "/my/model" and args.allowed_origins == ["http://a"]


def test_allowed_origins_repeats_and_splits_commas():
    args = parse("serve", "--allowed-origins", "http://a,http://b", "--allowed-origins", "*")
    assert args.allowed_origins == ["http://a", "http://b", "*"] and args.model_pos is None


@pytest.mark.parametrize("argv, message", [
    (["serve", "--port", "99999"], "argument --port: 99999 is not a TCP port (0..65535)"),
    (["generate", "--prompt", "x", "--max-tokens", "-1"], "--max-tokens: must be an integer >= 1"),
    (["generate", "--prompt", "x", "--top-p", "2"], "--top-p: must be in (0, 1], got 2"),
    (["generate", "--prompt", "x", "--temperature", "nan"],
     "--temperature: 'nan' must be a finite number"),
    (["serve", "--drain-timeout", "-1"], "--drain-timeout: must be >= 0, got -1"),
    (["chat", "--block-size", "12"], "--block-size: must be a power of two, got 12"),
    (["chat", "--kv-cache-memory-bytes", "lots"], "cannot read 'lots' as a size"),
    (["chat", "--sampling-seed", str(2 ** 70)], "--sampling-seed: must fit in 64 bits"),
])
def test_a_bad_flag_is_one_line_and_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.count("\n") == 1 and message in err


def test_version(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out == f"folio {__version__}\n"


def test_help_shows_defaults_and_explains_dtype_auto(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "the TCP port to listen on (default: 8000)" in text
    assert "(default: 127.0.0.1)" in text and "(default: 16)" in text
    assert "reuse the KV blocks of prompt prefixes computed before (default: on)" in text
    assert "auto is bfloat16 on CUDA and on CPUs that multiply bf16 natively" in text


def test_every_flag_has_a_help_sentence():
    from folio.cli_types import subcommand_parsers
    for name, parser in subcommand_parsers(build_parser()).items():
        for action in parser._actions:
            assert action.help, f"folio {name} {action.option_strings or action.dest} has no help"


# --------------------------------------------------------------------------- processes


def test_a_bad_flag_fails_before_torch_is_imported():
    start = time.monotonic()
    proc = folio("generate", "--prompt", "hi", "--max-tokens", "-1", timeout=30)
    assert time.monotonic() - start < 1.5
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "folio generate: error: argument --max-tokens: must be an integer >= 1, got -1 "
        "(see `folio generate --help`)"]
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, folio.cli; folio.cli.build_parser().parse_args("
                               "['serve', '--port', '1']); print('torch' in sys.modules)"],
        capture_output=True, text=True, timeout=30)
    assert probe.stdout == "False\n"


def test_a_bad_port_is_one_line_and_status_2():
    proc = folio("serve", "--port", "99999", timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["folio serve: error: argument --port: 99999 is not a "
                                        "TCP port (0..65535) (see `folio serve --help`)"]


def test_a_port_in_use_is_one_line_and_status_1_before_the_model_loads(tiny):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = folio("serve", "--model", tiny, "--port", str(port), *ENGINE)
    assert proc.returncode == 1 and proc.stdout == ""
    assert error_lines(proc.stderr) == [
        f"folio: error: port {port} on 127.0.0.1 is in use (Address already in use): stop "
        f"what listens there or pass another --port"]
    assert "environment (folio env)" not in proc.stderr        # logged once the model loaded


def broken_copy(tiny, tmp_path, name: str, break_it) -> str:
    folder = tmp_path / name
    shutil.copytree(tiny, folder)
    break_it(folder)
    return str(folder)


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["chat"],
                                     ["bench", "memory"]])
def test_a_missing_model_is_one_line_and_status_1(command, tmp_path):
    proc = folio(*command, "--model", str(tmp_path / "nope"))
    assert proc.returncode == 1, proc.stderr
    assert error_lines(proc.stderr) == [
        f"folio: error: model '{tmp_path / 'nope'}' not found: expected a Hugging Face folder "
        "with config.json, a .gguf file, a folder holding one .gguf file, or "
        "'SmolLM2-135M-Instruct' (Folio does not download from the Hugging Face hub)"]


@pytest.mark.parametrize("name, break_it, message", [
    ("bad-config", lambda d: (d / "config.json").write_text("{not json"), "cannot read"),
    ("no-hidden-size", lambda d: (d / "config.json").write_text('{"model_type": "llama"}'),
     "lacks"),
    ("cut-weights", lambda d: (d / "model.safetensors").write_bytes(b"\0" * 64),
     "deserializing header"),
    ("bad-tokenizer", lambda d: (d / "tokenizer.json").write_text('{"version": "1.0", '),
     "cannot read the tokenizer"),
])
def test_a_broken_checkpoint_is_one_line_and_status_1(tiny, tmp_path, name, break_it, message):
    proc = folio("generate", "--prompt", "hi", "--model", broken_copy(tiny, tmp_path, name,
                                                                      break_it), *ENGINE)
    lines = error_lines(proc.stderr)
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("folio: error: ") and message in lines[0]
