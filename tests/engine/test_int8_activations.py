"""The default model's quantized layers with int8 activations (native/qlinear.c's
int8 path, --activation-quantization int8, the default) against the same
codes multiplied in fp32 arithmetic (--activation-quantization none, fp32
activations on every CPU: --dtype float32).

Teacher forcing, as the bf16 tests do: both engines score the same texts
through prompt logprobs. A prompt runs many rows at once, where the engine
would keep fp32 arithmetic above folio_qlinear_int8_rows; here every layer
takes the int8 path at every row count (the LM head included), so the drift
measured is the whole of what a decode step sees. Measured on this model
(docs/benchmarks.md): mean |d logprob| 0.040-0.041 on every build; the max over
the 124 scored tokens 0.24 on AVX2 builds and 0.37 on AVX-512 ones (one token:
the next largest is 0.25 there), about 1.5x what a real bf16 run moves the
unquantized model (mean 0.026-0.028, max 0.13-0.21: test_bf16_fast_paths).
The int8 sums are exact and the AVX-512 and AVX2 kernels agree bit for bit on
the same x; the rest of the model's fp32 kernels differ in rounding, and a
rounding tie in x that falls the other way moves a near-tied token. The bounds
leave about half as much again.
"""

import pytest
import torch

from folio import LLM
from folio.kernels import native
from folio.model.layers.quantization.int_groups import IntGroupsLinear
from tests.engine.test_bf16_fast_paths import _scores, drift, greedy_texts

pytestmark = pytest.mark.threads(2)     # the kernels' threaded paths (tests/conftest.py)

needs_kernel = pytest.mark.skipif(not native.runs_qlinear(torch.zeros(1)),
                                  reason="no AVX2 + FMA + F16C or AVX-512 kernel on this "
                                         "machine (or no compiler)")

MEAN_BOUND, MAX_BOUND = 0.06, 0.55


@needs_kernel
def test_int8_activations_stay_close_to_fp32_arithmetic(monkeypatch):
    exact_llm = LLM(activation_quantization="none", dtype="float32", num_kv_blocks=128)
    texts = greedy_texts(exact_llm)
    exact = _scores(exact_llm, texts)
    exact_llm.shutdown()
    # int8 at every row count, the prompt's rows too
    monkeypatch.setattr(IntGroupsLinear, "quantize_x", lambda self, dtype: 2)
    int8_llm = LLM(activation_quantization="int8", dtype="float32", num_kv_blocks=128)
    model = int8_llm.engine.executor.runner.model
    methods = [m.quant_method for m in model.modules()
               if isinstance(getattr(m, "quant_method", None), IntGroupsLinear)]
    assert methods and all(m.int8 for m in methods)
    worst, mean = drift(int8_llm, texts, exact, "int8 activations - fp32 arithmetic")
    assert 0 < mean <= MEAN_BOUND and worst <= MAX_BOUND


@needs_kernel
def test_none_keeps_the_fp32_path_and_the_flag_reaches_every_layer():
    # fp32 activations (the default dtype on CPUs without AVX512-BF16; with it
    # the default is bf16, whose `none` path is int16)
    llm = LLM(activation_quantization="none", dtype="float32", num_kv_blocks=16)
    model = llm.engine.executor.runner.model
    methods = [m.quant_method for m in model.modules()
               if isinstance(getattr(m, "quant_method", None), IntGroupsLinear)]
    assert methods and not any(m.int8 for m in methods)
    assert {m.quantize_x(torch.float32) for m in methods} == {0}
    assert model.model.native_decoder.quantize_x == 0
    llm.shutdown()
    with pytest.raises(ValueError, match="activation_quantization must be one of auto, int8, none"):
        LLM(activation_quantization="int4")


@pytest.mark.parametrize("fixture, expected", [("gptq-w4-g32-sym", "none"), ("awq-w4-g32", "none"),
                                               ("ct-w4a16-g32", "none"), (None, "int8")])
def test_auto_runs_a_checkpoints_declared_activations(fixture, expected):
    """GPTQ, AWQ and compressed-tensors W4A16 checkpoints declare 16-bit
    activations: by default they run them (fp32 arithmetic on the CPU), and
    int8 stays an explicit choice; the default model's GGUF codes, Folio's
    own form, take int8 activations by default."""
    from pathlib import Path

    from folio.engine.config_builder import build_config
    model = None if fixture is None else str(Path(__file__).parents[1] / "fixtures" / "quant"
                                              / fixture)
    assert build_config(model, dtype="float32").activation_quantization == expected
    assert build_config(model, dtype="float32",
                        activation_quantization="int8").activation_quantization == "int8"
