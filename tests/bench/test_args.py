"""`folio bench` rejects bad values while parsing, before a model loads or a
request is sent, and a server that is down is one line, not a traceback."""

import argparse
import socket
import subprocess
import sys
import time

import pytest

from folio.bench.args import format_range
from folio.bench.memory import add_memory_args
from folio.bench.serve import add_serve_args
from folio.bench.throughput import add_throughput_args
from folio.cli import build_parser, main


def run_cli(*argv: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "folio.cli", *argv], capture_output=True,
                          text=True, timeout=60)
    return proc, time.perf_counter() - t0


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]      # nothing listens once the socket is closed


def test_a_reversed_range_exits_2_at_once_with_one_line():
    proc, seconds = run_cli("bench", "throughput", "--input-len", "5:2")
    assert proc.returncode == 2
    # Loading the default model takes ~8 s; parsing alone well under one
    # (a generous bound for a busy 2-core machine).
    assert seconds < 3, seconds
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("folio bench throughput: error: argument --input-len:")
    assert "1 <= A <= B" in lines[0] and "'5:2'" in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_building_the_parser_imports_no_torch():
    code = "import sys, folio.cli; folio.cli.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("argv, message", [
    (["throughput", "--input-len", "x"], "'x' is not a length or a range A:B"),
    (["throughput", "--output-len", "0:4"], "1 <= A <= B"),
    (["throughput", "--num-prompts", "0"], ">= 1, got 0"),
    (["throughput", "--batch-size", "-2"], ">= 1, got -2"),
    (["throughput", "--baseline-limit", "1.5"], "'1.5' is not an integer"),
    (["throughput", "--dataset", "/no/such.jsonl"], "there is no file '/no/such.jsonl'"),
    (["serve", "--input-len", "5:2"], "1 <= A <= B, got '5:2'"),
    (["serve", "--request-rate", "0"], "a request rate must be > 0"),
    (["serve", "--request-rate", "nan"], "a request rate must be > 0"),
    (["serve", "--sweep-rates", "1,,4"], "comma-separated rates"),
    (["serve", "--sweep-rates", "1,-2"], "a request rate must be > 0 (or 'inf'), got '-2'"),
    (["serve", "--max-concurrency", "0"], ">= 1, got 0"),
    (["serve", "--slo", "ttft=5"], "unknown SLO 'ttft'"),
    (["serve", "--slo", "ttft_ms=fast"], "an SLO is NAME=MILLISECONDS"),
    (["serve", "--slo", "tpot_ms=0"], "an SLO target must be > 0 ms"),
    (["serve", "--base-url", "127.0.0.1:8000"], "expected a URL such as http://"),
    (["serve", "--plot", "/no/such/folder/sweep.png"], "the folder '/no/such/folder'"),
    (["serve", "--from-result", "/no/such.json"], "no such file"),
    (["memory", "--prompt-len", "0"], ">= 1, got 0"),
    (["memory", "--waste-requests", "-1"], ">= 0, got -1"),
    (["memory", "--waste-input-len", "9:3"], "1 <= A <= B"),
])
def test_bad_values_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["bench", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"folio bench {argv[0]}: error: argument {argv[1]}")
    assert message in err[0]


def test_good_values_parse_to_what_the_benchmarks_use():
    args = build_parser().parse_args(
        ["bench", "serve", "--input-len", "7", "--sweep-rates", "0.5,2,inf",
         "--slo", "ttft_ms=500,tpot_ms=50", "--base-url", "http://127.0.0.1:8123/"])
    assert args.input_len == (7, 7) and args.output_len == (32, 192)
    assert args.sweep_rates == [0.5, 2.0, float("inf")]
    assert args.slo == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    assert args.base_url == "http://127.0.0.1:8123"          # no '//v1/...' later
    assert args.request_rate == float("inf") and args.max_concurrency is None
    assert format_range(args.input_len) == "7" and format_range(args.output_len) == "32:192"
    memory = build_parser().parse_args(["bench", "memory", "--waste-requests", "0"])
    assert memory.waste_requests == 0 and memory.waste_input_len == (32, 384)


@pytest.mark.parametrize("add_args", [add_throughput_args, add_serve_args, add_memory_args])
def test_every_bench_flag_has_a_sentence_of_help(add_args):
    parser = argparse.ArgumentParser()
    add_args(parser)
    for action in parser._actions:
        if action.dest != "help":
            assert action.help and len(action.help.split()) >= 3, action.option_strings
            # cli.py's help formatter appends the default: a help text must not repeat it
            assert "(default" not in action.help, action.option_strings


def test_a_server_that_is_down_is_one_line_and_a_nonzero_exit():
    url = f"http://127.0.0.1:{closed_port()}"
    proc, seconds = run_cli("bench", "serve", "--base-url", url, "--num-prompts", "2")
    assert proc.returncode != 0 and seconds < 10
    assert proc.stderr.strip() == f"folio: error: cannot reach {url}: connection refused"
    assert proc.stdout == ""


def test_a_sweep_against_a_server_that_is_down_writes_nothing(tmp_path, capsys):
    png, saved = tmp_path / "s.png", tmp_path / "s.json"
    url = f"http://127.0.0.1:{closed_port()}"
    assert main(["bench", "serve", "--base-url", url, "--model", "named", "--sweep-rates",
                 "1,inf", "--plot", str(png), "--save-result", str(saved)]) != 0
    assert "cannot reach" in capsys.readouterr().err
    assert not png.exists() and not saved.exists()
