"""`folio bench serve` against a real server: runs, reports, saves, plots."""

import json

from folio.cli import main


def test_bench_serve_run_and_sweep(server, tiny_model, tmp_path, capsys):
    saved, png = tmp_path / "result.json", tmp_path / "sweep.png"
    common = ["bench", "serve", "--base-url", server.url, "--tokenizer", tiny_model,
              "--num-prompts", "6", "--input-len", "4:8", "--output-len", "3:5",
              "--max-concurrency", "4"]
    assert main(common + ["--request-rate", "50", "--slo", "ttft_ms=60000,tpot_ms=60000",
                          "--save-result", str(saved), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    run = result["runs"][0]
    assert result["model"] == "tiny" and run["completed"] == 6 and run["failed"] == 0
    assert run["goodput"] > 0 and run["output_throughput"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(run[key]) == {"mean", "median", "p99"} and run[key]["median"] is not None
    assert json.loads(saved.read_text()) == result
    assert main(common + ["--endpoint", "/v1/chat/completions", "--sweep-rates", "20,inf",
                          "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.count("rate ") == 2


def test_each_rate_of_a_sweep_draws_its_own_prompts(server, tiny_model, capsys):
    """Otherwise every rate after the first would find its prompts in the
    server's prefix cache and report prefill-free first tokens."""
    from tests.server.test_lifecycle import metrics
    common = ["bench", "serve", "--base-url", server.url, "--tokenizer", tiny_model,
              "--num-prompts", "4", "--input-len", "24:32", "--output-len", "2:3",
              "--seed", "500"]
    before = metrics(server)["folio:prefix_cache_hits_total"]
    assert main(common + ["--sweep-rates", "inf,inf,inf", "--plot", "/dev/null"]) == 0
    assert metrics(server)["folio:prefix_cache_hits_total"] == before
    assert main(common + ["--request-rate", "inf"]) == 0      # seed 500 again: cached
    assert metrics(server)["folio:prefix_cache_hits_total"] >= before + 4 * 16
    capsys.readouterr()
