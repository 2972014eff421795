"""The bf16 CPU fast paths (native fused element-wise kernels, oneDNN-packed
weights) against the plain torch layers in the same dtype, on the default model.

Exact greedy tokens cannot be the test here: in bf16 any change in the order of
a sum moves logits by about 1e-2, enough to flip a near-tie a few tokens in, and
from there the continuations differ. So the engines score the same text
(teacher forcing, through prompt logprobs), and the fast paths must stay as
close to fp32's logprobs as the plain bf16 layers are; fp32 keeps exact-token
parity elsewhere in the suite.
"""

import pytest
import torch

from folio import LLM, SamplingParams
from folio.kernels import native
from folio.model.layers import linear as linear_mod
from folio.worker import device

pytestmark = pytest.mark.threads(2)     # the kernels' threaded paths (tests/conftest.py)

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "List three colours of the rainbow:", "1, 2, 3, 5, 8,"]


def greedy_texts(llm, prompts=PROMPTS, max_tokens=24):
    """Each prompt's ids followed by the model's own 24 greedy tokens: the text
    that the drift tests score by teacher forcing."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                ignore_eos=True))
    return [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]


def _scores(llm, token_ids):
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in token_ids], params)
    return [[d[t] for d, t in zip(o.prompt_logprobs[1:], ids[1:])]
            for o, ids in zip(outs, token_ids)]


def drift(llm, texts, reference, what):
    """`llm`'s teacher-forced logprobs of `texts` against `reference`'s (shut
    down after): the max and mean |d logprob|, printed under `what`."""
    got = _scores(llm, texts)
    llm.shutdown()
    worst, mean = _errors(got, reference)
    print(f"|{what}| max {worst:.4f} mean {mean:.4f} "
          f"over {sum(len(s) for s in reference)} tokens")
    return worst, mean


def _errors(scores, reference):
    diffs = [abs(a - b) for s, r in zip(scores, reference) for a, b in zip(s, r)]
    return max(diffs), sum(diffs) / len(diffs)


@pytest.mark.skipif(native.load() is None, reason="no C compiler here")
def test_fast_paths_are_as_close_to_fp32_as_the_plain_layers(monkeypatch):
    # bf16 arithmetic throughout, even where the CPU would run bfloat16 as fp32
    # arithmetic on bf16 weights (test_bf16_weights.py tests that path)
    monkeypatch.setattr(device, "split_cpu_bf16", lambda dtype, dev: (dtype, None))
    fast = LLM(dtype="bfloat16", num_kv_blocks=128, quantization="none")
    down = fast.engine.executor.runner.model.model.layers[0].mlp.down_proj
    # Packed where this CPU packs bf16 weights (AVX-512); AVX2-only CPUs keep F.linear.
    assert (down.packed is not None) == (linear_mod.pack_weight(torch.zeros(16, 16).bfloat16())
                                         is not None)
    texts = greedy_texts(fast)
    got = _scores(fast, texts)
    fast.shutdown()
    reference = LLM(dtype="float32", num_kv_blocks=128, quantization="none")
    exact = _scores(reference, texts)
    reference.shutdown()
    monkeypatch.setattr(native, "fuses", lambda x: False)
    monkeypatch.setattr(native, "supports", lambda q: False)
    monkeypatch.setattr(linear_mod, "pack_weight", lambda w, store=None: None)
    plain = LLM(dtype="bfloat16", num_kv_blocks=128, quantization="none")
    assert plain.engine.executor.runner.model.model.layers[0].mlp.down_proj.packed is None
    expected = _scores(plain, texts)
    plain.shutdown()
    assert [len(s) for s in got] == [len(t) - 1 for t in texts]
    fast_max, fast_mean = _errors(got, exact)
    plain_max, plain_mean = _errors(expected, exact)
    print(f"|fast - fp32| max {fast_max:.4f} mean {fast_mean:.4f}; "
          f"|plain - fp32| max {plain_max:.4f} mean {plain_mean:.4f}; "
          f"|fast - plain| {_errors(got, expected)}")
    assert fast_mean <= 1.25 * plain_mean + 0.005
    assert fast_max <= 1.5 * plain_max + 0.05
