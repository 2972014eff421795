"""bfloat16 on a CPU without native bf16: fp32 arithmetic on bf16-stored linear
weights (the AVX2 kernel), on the default model.

As in test_bf16_fast_paths, the engines score the same text (teacher forcing,
through prompt logprobs). The path keeps bf16's rounding of the weights only,
so it must be at least as close to fp32's logprobs as a real bf16 run (every
activation rounded to bf16 too), measured in the same test; on this path the
KV cache and activations stay fp32.
"""

import pytest
import torch

from folio import LLM, SamplingParams
from folio.kernels import native
from folio.worker import device
from tests.engine.test_bf16_fast_paths import _errors, _scores, greedy_texts

pytestmark = pytest.mark.threads(2)     # the kernels' threaded paths (tests/conftest.py)

needs_kernel = pytest.mark.skipif(not native.packs_linear_bf16w(torch.zeros(8, 8)),
                                  reason="no AVX2 + FMA kernel on this machine (or no compiler)")


@needs_kernel
def test_bf16_weights_are_as_close_to_fp32_as_bf16_and_halve_the_weights(monkeypatch):
    reference = LLM(dtype="float32", num_kv_blocks=128, quantization="none")
    texts = greedy_texts(reference)
    exact = _scores(reference, texts)
    fp32_bytes = _linear_weight_bytes(reference)
    reference.shutdown()
    # a real bf16 run (emulated where the CPU has no bf16): the accuracy class
    monkeypatch.setattr(device, "split_cpu_bf16", lambda dtype, dev: (dtype, None))
    bf16 = LLM(dtype="bfloat16", num_kv_blocks=128, quantization="none")
    expected = _scores(bf16, texts)
    bf16.shutdown()
    monkeypatch.undo()
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    split = LLM(dtype="bfloat16", num_kv_blocks=128, quantization="none")
    config, model = split.engine.config, split.engine.executor.runner.model
    assert (config.dtype, config.weight_dtype) == ("float32", "bfloat16")
    layers = [m for m in model.modules() if getattr(m, "packed", None) is not None]
    assert layers and all(m.packed.bf16_weights for m in layers)
    assert model.lm_head.packed.bf16_weights
    assert _linear_weight_bytes(split) * 2 == fp32_bytes
    got = _scores(split, texts)
    split.shutdown()
    split_max, split_mean = _errors(got, exact)
    bf16_max, bf16_mean = _errors(expected, exact)
    print(f"|bf16 weights - fp32| max {split_max:.4f} mean {split_mean:.4f}; "
          f"|bf16 - fp32| max {bf16_max:.4f} mean {bf16_mean:.4f}")
    assert split_mean <= bf16_mean and split_max <= bf16_max


def _linear_weight_bytes(llm) -> int:
    """Bytes of the decoder layers' linear weights (the LM head keeps a plain copy
    for the embedding it shares)."""
    total = 0
    for layer in llm.engine.executor.runner.model.model.layers:
        for m in layer.modules():
            if hasattr(m, "packed") and hasattr(m, "weight"):
                w = m.packed.data if m.packed is not None else m.weight
                total += w.numel() * w.element_size()
    return total


@needs_kernel
@pytest.mark.parametrize("tied", [False, True])
def test_tiny_models_split_give_the_rounded_weights_answers(tmp_path, monkeypatch, tied):
    """On a tiny model whose weights are rounded to bf16 first, the split and plain
    fp32 compute the same products (in another summation order): the same greedy
    tokens. An untied LM head keeps only its bf16 copy; a tied one keeps the
    plain table that the embedding reads."""
    from tests.utils import make_tiny_model
    from safetensors.torch import load_file, save_file
    path = make_tiny_model(tmp_path / "m", tie_word_embeddings=tied)
    weights = load_file(f"{path}/model.safetensors")
    save_file({k: v.bfloat16().float() for k, v in weights.items()}, f"{path}/model.safetensors",
              metadata={"format": "pt"})
    prompts = [{"prompt_token_ids": [1, 20 + i, 30, 40, 50]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(path, dtype="float32", num_kv_blocks=64).generate(prompts, params)
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    # the cache kept in fp32 as the plain run's (auto would keep it in bf16)
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=64, kv_cache_dtype="float32")
    head = llm.engine.executor.runner.model.lm_head
    assert head.packed.bf16_weights and (head.weight.numel() > 0) == tied
    split = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in split] == [o.outputs[0].token_ids for o in plain]
