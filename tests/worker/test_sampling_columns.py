"""The runner's persistent sampling state (worker/sampling_columns.py): the
penalty counts kept up to date step by step, through sequences that start,
grow, fork, start over (recomputed after a preemption) and end, with their
rows reused, equal the ones made from each row's whole history; and so do
the bias and min_tokens inputs, and the parameters gathered from the
columns."""

import random

import numpy as np
import pytest
import torch

from folio.core.outputs import SamplingInfo
from folio.sampling_params import SamplingParams
from folio.worker.sampling_columns import SamplingColumns
from tests.model.native_builds import builds, library
from tests.utils import triton_device

pytestmark = pytest.mark.threads(2)     # the kernels' threaded paths (tests/conftest.py)

V = 97


def _row_by_row(infos, histories, extra):
    n = len(infos)
    counts = torch.zeros(n, V)
    seen = torch.zeros(n, V, dtype=torch.bool)
    banned = torch.zeros(n, V, dtype=torch.bool)
    bias = torch.zeros(n, V)
    for row, (info, history) in enumerate(zip(infos, histories)):
        history = (history or []) + extra.get(row, [])
        outputs = history[info.num_prompt_tokens:]
        if info.params.needs_history:
            for t in outputs:
                counts[row, t] += 1
            for t in history:
                seen[row, t] = True
        for t, v in (info.params.logit_bias or {}).items():
            bias[row, t] = v
        if info.params.min_tokens and len(outputs) < info.params.min_tokens:
            banned[row, list(info.min_tokens_banned)] = True
    return counts, seen, bias, banned


def _info(rng):
    kind = rng.choice(["penalty", "bias", "min_tokens", "plain", "sampled"])
    params = SamplingParams(
        temperature=0.7 if kind in ("sampled", "penalty") else 0.0,
        top_k=rng.choice([0, 5]), top_p=rng.choice([1.0, 0.9]),
        repetition_penalty=1.3 if kind == "penalty" else 1.0,
        frequency_penalty=0.5 if kind == "penalty" else 0.0,
        presence_penalty=0.25 if kind == "penalty" else 0.0,
        logit_bias={rng.randrange(V): rng.uniform(-5, 5) for _ in range(3)}
        if kind == "bias" else None,
        min_tokens=rng.randint(1, 6) if kind == "min_tokens" else 0,
        logprobs=rng.choice([None, 0, 3]))
    return SamplingInfo(params, rng.getrandbits(63), rng.randint(0, 8),
                        (1, 2) if kind == "min_tokens" else ())


@pytest.mark.parametrize("seed", range(8))
def test_counts_kept_up_to_date_equal_the_ones_made_from_histories(seed):
    rng = random.Random(seed)
    cols = SamplingColumns(V, torch.device("cpu"), rows=2)     # grows as rows are taken
    live: dict[int, tuple[SamplingInfo, list[int]]] = {}       # row -> (info, history)
    free, next_row = [], 0

    def take_row():
        nonlocal next_row
        if free:
            return free.pop()
        next_row += 1
        return next_row - 1

    def grow(row, tokens):
        info, history = live[row]
        if info.params.needs_history:
            cols.penalties.add(row, tokens, len(history), info.num_prompt_tokens)
        history.extend(tokens)

    for _ in range(60):
        op = rng.choice(["start", "start", "grow", "grow", "grow", "fork", "restart", "end"])
        if op == "start" or not live:
            row, info = take_row(), _info(rng)
            cols.set(row, info)
            live[row] = (info, [])
            grow(row, [rng.randrange(V // 4) for _ in range(rng.randint(0, 12))])
        elif op == "grow":
            for row in rng.sample(sorted(live), rng.randint(1, len(live))):
                grow(row, [rng.randrange(V // 4) for _ in range(rng.randint(1, 3))])
        elif op == "fork":
            parent = rng.choice(sorted(live))
            info, history = live[parent]
            row = take_row()
            cols.set(row, info)
            if info.params.needs_history:
                cols.penalties.copy(parent, row, cols.num_rows)
            live[row] = (info, list(history))
        elif op == "restart":             # recomputed from its start: a new prefix
            row = rng.choice(sorted(live))
            info, history = live[row]
            prefix = history[:rng.randint(0, len(history))]
            if info.params.needs_history:
                cols.penalties.reset(row)
            history.clear()
            grow(row, prefix)
        else:
            row = rng.choice(sorted(live))
            del live[row]
            free.append(row)
        if live and rng.random() < 0.5:   # a step samples some rows, in some order
            rows = rng.sample(sorted(live), rng.randint(1, len(live)))
            extra = {i: [rng.randrange(V // 4) for _ in range(rng.randint(1, 2))]
                     for i in range(len(rows)) if rng.random() < 0.3   # proposals:
                     and len(live[rows[i]][1]) >= live[rows[i]][0].num_prompt_tokens}  # outputs
            batch = cols.batch(np.array(rows), np.arange(len(rows)),
                               [live[r][1] for r in rows], sorted(extra.items()))
            infos = [live[r][0] for r in rows]
            expect = _row_by_row(infos, [live[r][1] for r in rows], extra)
            if batch.all_greedy:      # nothing but the argmax: no tensors made for it
                assert batch.temperature is None and batch.keys is None
            else:
                assert torch.equal(batch.temperature,
                                   torch.tensor([i.temperature for i in infos]))
                assert torch.equal(batch.top_p, torch.tensor([i.params.top_p for i in infos]))
                assert batch.keys.shape == (len(rows),)
            assert batch.max_logprobs == max(i.params.logprobs or 0 for i in infos)
            assert list(batch.random) == [i.temperature > 0 for i in infos]
            a = batch.adjust
            if a is None:
                assert not any(i.params.needs_history or i.params.logit_bias
                               or i.params.min_tokens for i in infos)
                continue
            penalized = torch.tensor([i.params.needs_history for i in infos])
            counts, seen = a.output_counts, a.seen
            if a.rows is not None:        # the persistent tables, read by row
                assert not extra and torch.equal(a.rows, torch.tensor(rows))
                counts, seen = counts[a.rows], seen[a.rows]
            # rows without penalties may hold another sequence's old counts:
            # their penalties are 0 (and 1), so nothing reads them
            assert torch.equal(counts[penalized], expect[0][penalized])
            assert torch.equal(seen[penalized], expect[1][penalized])
            assert torch.equal(a.bias if a.bias is not None else torch.zeros(len(rows), V),
                               expect[2])
            assert torch.equal(a.banned if a.banned is not None else
                               torch.zeros(len(rows), V, dtype=torch.bool), expect[3])


def test_a_row_without_penalties_is_left_unchanged_by_the_counts_of_another():
    """The adjustments leave a penalty-free row's logits exactly as they were,
    whatever its counts' row held before."""
    from folio.model.layers.sampler import apply_adjustments
    cols = SamplingColumns(V, torch.device("cpu"), rows=2)
    cols.set(0, SamplingInfo(SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0), 1, 0))
    cols.penalties.add(0, [3, 3, 4], 0, 0)
    cols.set(0, SamplingInfo(SamplingParams(), 2, 0))          # the row reused
    cols.set(1, SamplingInfo(SamplingParams(presence_penalty=1.0), 3, 0))
    cols.penalties.add(1, [5], 0, 0)
    batch = cols.batch(np.array([0, 1]), None, [None, [5]], [])
    logits = torch.randn(2, V)
    out = apply_adjustments(logits, batch.adjust)
    assert torch.equal(out[0], logits[0])
    assert out[1, 5] == logits[1, 5] - 1.0


def _penalty_case():
    g = torch.Generator().manual_seed(0)
    R, S, vocab = 9, 6, 3001
    counts = torch.randint(0, 3, (R, vocab), generator=g).float()
    counts[torch.rand(R, vocab, generator=g) < 0.9] = 0
    seen = (counts > 0) | (torch.rand(R, vocab, generator=g) < 0.05)
    rows = torch.tensor([4, 0, 8, 4, 2, 7])
    presence = torch.tensor([0.0, 0.5, 1.5, 0.0, -0.3, 0.0])
    frequency = torch.tensor([0.0, 0.25, 0.0, 1.0, 0.1, 0.0])
    repetition = torch.tensor([1.0, 1.2, 0.8, 1.0, 2.0, 1.0])
    logits = 3 * torch.randn(S, vocab, generator=g)
    return logits, (counts, seen, rows, presence, frequency, repetition)


def _reference(logits, args):
    from folio.model.layers.sampler import LogitAdjustments, apply_adjustments
    counts, seen, rows, presence, frequency, repetition = args
    return apply_adjustments(logits, LogitAdjustments(presence, frequency, repetition,
                                                      counts[rows], seen[rows], None, None))


@pytest.mark.parametrize("flags", builds())
def test_native_penalties_read_in_place_equal_the_torch_definition(flags):
    from folio.kernels import native
    lib = library(flags)
    logits, args = _penalty_case()
    got = native.penalize(logits, *args, lib=lib)
    assert torch.equal(got, _reference(logits, args))
    assert torch.equal(got[5], logits[5])          # a row without penalties: untouched


def test_triton_penalties_read_in_place_equal_the_torch_definition(monkeypatch):
    device = triton_device(monkeypatch)
    from folio.kernels import triton_sampling
    logits, args = _penalty_case()
    got = triton_sampling.penalize(logits.to(device), *(a.to(device) for a in args)).cpu()
    # (a GPU may fuse the frequency product into its subtraction: one rounding)
    assert torch.allclose(got, _reference(logits, args), rtol=1e-6, atol=1e-6)
