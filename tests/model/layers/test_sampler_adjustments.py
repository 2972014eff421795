"""The sampler's penalty, bias and min_tokens inputs, made for all rows at once,
equal the ones made row by row (the way they were made before), on random
batches: rows without history, histories shorter than their prompts, repeated
tokens, logit biases and min_tokens bans."""

import random

import pytest
import torch

from folio.core.outputs import SamplingInfo
from folio.model.layers.sampler import _adjustments
from folio.sampling_params import SamplingParams

V = 97


def _row_by_row(infos, histories):
    n = len(infos)
    counts = torch.zeros(n, V)
    seen = torch.zeros(n, V, dtype=torch.bool)
    banned = torch.zeros(n, V, dtype=torch.bool)
    bias = torch.zeros(n, V)
    for row, (info, history) in enumerate(zip(infos, histories)):
        history = history or []
        outputs = history[info.num_prompt_tokens:]
        for t in outputs:
            counts[row, t] += 1
        for t in history:
            seen[row, t] = True
        for t, v in (info.params.logit_bias or {}).items():
            bias[row, t] = v
        if info.params.min_tokens and len(outputs) < info.params.min_tokens:
            banned[row, list(info.min_tokens_banned)] = True
    return counts, seen, bias, banned


@pytest.mark.parametrize("seed", range(6))
def test_all_rows_at_once_equal_row_by_row(seed):
    rng = random.Random(seed)
    infos, histories = [], []
    for _ in range(rng.randint(1, 12)):
        kind = rng.choice(["penalty", "bias", "min_tokens", "plain"])
        params = SamplingParams(
            repetition_penalty=1.3 if kind == "penalty" else 1.0,
            frequency_penalty=0.5 if kind == "penalty" else 0.0,
            logit_bias={rng.randrange(V): rng.uniform(-5, 5) for _ in range(3)}
            if kind == "bias" else None,
            min_tokens=rng.randint(1, 6) if kind == "min_tokens" else 0)
        prompt = rng.randint(0, 8)
        history = None if kind in ("bias", "plain") else \
            [rng.randrange(V // 4) for _ in range(rng.randint(0, 14))]
        infos.append(SamplingInfo(params, 0, prompt, (1, 2) if kind == "min_tokens" else ()))
        histories.append(history)
    got = _adjustments(infos, histories, V, torch.device("cpu"))
    if got is None:
        assert not any(i.needs_history or i.params.logit_bias for i in infos)
        return
    counts, seen, bias, banned = _row_by_row(infos, histories)
    assert torch.equal(got.output_counts, counts) and torch.equal(got.seen, seen)
    assert torch.equal(got.bias if got.bias is not None else torch.zeros(len(infos), V), bias)
    assert torch.equal(got.banned if got.banned is not None else
                       torch.zeros(len(infos), V, dtype=torch.bool), banned)
