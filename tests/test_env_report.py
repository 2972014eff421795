"""`folio env` reports the kernels a run really takes: checked against an
engine built here, in both dtypes, whatever this CPU is."""

import pytest

from folio import LLM
from folio.env_report import collect, format_report, kernel_choices
from tests.utils import make_tiny_model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bfloat16 on a CPU without bf16"])
def test_the_report_matches_the_layers_an_engine_builds(tmp_path, monkeypatch, dtype):
    if dtype.endswith("without bf16"):            # the split, wherever the AVX2 kernel is
        from folio.worker import device
        monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
        dtype = "bfloat16"
    llm = LLM(make_tiny_model(tmp_path / "m"), dtype=dtype, num_kv_blocks=16)
    model = llm.engine.executor.runner.model
    down = model.model.layers[0].mlp.down_proj
    choices = kernel_choices(dtype)
    assert (model.model.native_decoder is not None) == \
        choices["decoder layers"].startswith("one native call")
    if down.packed is None:
        assert choices["linear"].startswith("F.linear")
    elif down.packed.bf16_weights:
        assert choices["linear"].startswith("AVX2 kernel: fp32 arithmetic on bfloat16")
    elif down.packed.native:
        assert choices["linear"].startswith("native bf16 kernel")
    else:
        assert choices["linear"].startswith("oneDNN")


def test_the_report_names_the_cpu_flags_and_the_auto_dtype():
    report = collect()
    text = format_report(report)
    assert report["cpu"] and f"dtype auto: {report['dtype auto']}" in text
    assert report["dtype auto"] in ("float32", "bfloat16")
    assert report["native bf16"] <= ("avx512_bf16" in report["cpu flags"]
                                     or "amx_bf16" in report["cpu flags"])
    assert "kernels for bfloat16:" in text and "kernels for float32:" in text


def test_folio_env_prints_the_report(capsys):
    import json

    from folio.cli import main
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["kernels"]) == {"float32", "bfloat16"}
    assert main(["env"]) == 0
    assert "kernels for bfloat16:" in capsys.readouterr().out
