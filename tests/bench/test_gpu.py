"""benchmarks/gpu.sh (`folio bench gpu`) dry-run: --tiny runs every step of
the GPU benchmark on tiny shapes, here on the CPU with the Triton kernels in
triton's interpreter, and writes its JSON and markdown. (The figures of a real
GPU run go to docs/benchmarks.md; none are asserted here.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from folio.cli import main

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()


def test_the_script_dry_runs_every_step(tmp_path):
    pytest.importorskip("triton", reason="the benchmark runs the TRITON backend")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run([str(ROOT / "benchmarks" / "gpu.sh"), "--tiny", "--profile",
                           "--out", str(out), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    table = (out / "result.md").read_text()
    partial = json.loads((out / "result.partial.json").read_text())    # the last step's
    assert partial["throughput"] == result["throughput"] and "_requests" not in partial
    # the headline figures, each in its own file as soon as it is measured
    da = json.loads((out / "decode_attention.json").read_text())
    assert da == result["decode_attention"] and da["default"]["us"] > 0
    assert da["best"]["bandwidth_fraction"] > 0 and da["batch"] == 4
    assert "| decode attention alone, default (batch 4, context 40) |" in table
    for name in ("batch1", "throughput", "served"):
        headline = json.loads((out / f"{name}.json").read_text())
        assert headline["device"].startswith("CPU") or CUDA
        assert {k: v for k, v in headline.items() if k != "device"}.items() \
            <= result[name].items()
    c = result["correctness"]
    assert c["tokens"] == 3 * 8 and c["agree"] == c["tokens"]    # fp32: TRITON = torch
    lp = result["logprobs"]        # fp32 on the CPU: the two backends to fp32 rounding
    assert lp["positions"] == 11 + 39 and lp["max_abs_diff"] < 1e-3 and lp["mean_logprob"] < 0
    assert result["batch1"]["ms_per_token"] > 0 and result["throughput"]["requests"] == 4
    assert 4 * 4 <= result["throughput"]["output_tokens"] <= 4 * 12     # output 4..12 each
    # every step of the throughput run recorded: with prompt tokens, and decodes
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    by_step = result["throughput"]["by_step"]
    assert len(rows) == by_step["decode"]["steps"] + by_step["prefill"]["steps"]
    assert sum(r["tokens"] for r in rows) >= result["throughput"]["output_tokens"] + 4 * 8
    assert all(r["ms"] > 0 and r["context"] >= r["tokens"] for r in rows)
    s = result["served"]
    assert s["completed"] == 4 and s["failed"] == 0 and s["ttft_ms"]["median"] > 0
    assert s["itl_ms"]["median"] > 0 and s["output_throughput"] > 0
    assert result["transformers"]["requests"] == 2
    # --quantization fp8 beside bf16 (issue 54), on the same requests
    f = json.loads((out / "fp8.json").read_text())
    assert {k: v for k, v in f.items() if k != "device"}.items() <= result["fp8"].items()
    assert f["batch1"]["tokens_per_s"] > 0 and f["throughput"]["requests"] == 4
    assert f["fp8_products"] == (CUDA and torch.cuda.get_device_capability() >= (8, 9))
    assert f["throughput_vs_bf16"] == pytest.approx(
        f["throughput"]["output_tokens_per_s"] / result["throughput"]["output_tokens_per_s"])
    assert 0 < f["weight_bytes"] < result["batch1"]["weight_bytes"]
    assert "| fp8 (-q fp8), batch-1 decode |" in table and "x bf16" in table
    assert result["speedup_over_transformers"] == pytest.approx(
        result["throughput"]["output_tokens_per_s"]
        / result["transformers"]["output_tokens_per_s"])
    assert "| batch-1 decode |" in table and table == done.stdout
    assert "| served | 4 streams:" in table and "| throughput run, decode steps |" in table
    assert "| throughput run, prompt steps |" in table
    assert (tmp_path / "work" / "model" / "config.json").exists()
    for batch in (1, 4):     # --profile: decode steps timed and their ops listed
        p = result["profile"][f"batch{batch}"]
        assert p["wall_ms_per_step"] > 0 and f"| decode step at batch{batch} |" not in table
        assert f"| decode step at batch {batch} |" in table
        assert f"== decode at batch {batch}:" in (out / "profile.txt").read_text()
    assert result["profile"]["mixed"]["wall_ms_per_step"] > 0 and "| mixed step |" in table
    assert "== mixed:" in (out / "profile.txt").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_the_full_run_needs_a_gpu(tmp_path, capsys):
    assert main(["bench", "gpu", "--out", str(tmp_path)]) == 1
    assert "needs a CUDA device (or --tiny" in capsys.readouterr().err


def _fake_python(path: Path, name: str) -> None:
    """An executable that says which python it is and what it was asked to run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "{name} $*"\n')
    path.chmod(0o755)


@pytest.mark.parametrize("has_venv, python_env, expected", [
    (True, None, "venv"),          # after `make run`: the checkout's .venv, which has torch
    (False, None, "system"),       # no .venv: the machine's own python3
    (True, "chosen", "chosen"),    # PYTHON wins over both
])
def test_the_script_picks_the_checkouts_venv_python(tmp_path, has_venv, python_env, expected):
    checkout = tmp_path / "checkout"
    (checkout / "benchmarks").mkdir(parents=True)
    script = checkout / "benchmarks" / "gpu.sh"
    script.write_text((ROOT / "benchmarks" / "gpu.sh").read_text())
    script.chmod(0o755)
    if has_venv:
        _fake_python(checkout / ".venv" / "bin" / "python", "venv")
    _fake_python(tmp_path / "bin" / "python3", "system")
    _fake_python(tmp_path / "chosen", "chosen")
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env["PATH"] = f"{tmp_path / 'bin'}:{env['PATH']}"
    if python_env:
        env["PYTHON"] = str(tmp_path / python_env)
    done = subprocess.run([str(script), "--tiny"], capture_output=True, text=True, env=env,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{expected} -m folio.cli bench gpu --tiny\n"
