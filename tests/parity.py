"""Greedy parity against transformers, with the one tolerance the issue allows:
two runs may part ways at a step where the reference's top-2 logprob gap is
below 1e-3 (a near-tie that rounding may flip); nothing after it is compared."""

from __future__ import annotations

import torch

TIE_GAP = 1e-3


@torch.inference_mode()
def reference_greedy(model, prompt_ids: list[int], max_new_tokens: int,
                     eos_token_ids) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and, per step, the top-2 logprob gap."""
    ids = torch.tensor([prompt_ids])
    if not eos_token_ids:       # run to max_new_tokens whatever the model's own config says
        model.generation_config.eos_token_id = None
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=list(eos_token_ids) or None,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    gaps = []
    for logits in out.logits:
        top2 = torch.log_softmax(logits[0].float(), dim=-1).topk(2).values
        gaps.append((top2[0] - top2[1]).item())
    return tokens, gaps


def assert_greedy_parity(ours: list[int], ref: list[int], gaps: list[float], label="",
                         tie_gap: float = TIE_GAP) -> int:
    """Equal token for token, or equal up to a near-tie (a top-2 gap under
    `tie_gap`); returns tokens compared."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert gaps[i] < tie_gap, (
                f"{label}: token {i} differs ({a} vs reference {b}) with top-2 gap "
                f"{gaps[i]:.2e} >= {tie_gap}\nours: {ours}\nref:  {ref}")
            return i
    assert len(ours) == len(ref), f"{label}: lengths differ\nours: {ours}\nref:  {ref}"
    return len(ours)


def prompt_logprobs(llm, ids: list[int]) -> torch.Tensor:
    """The engine's logprob of each prompt token after the first (teacher forcing)."""
    from folio import SamplingParams
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None
    return torch.tensor([entry[t] for entry, t in zip(out.prompt_logprobs[1:], ids[1:])])


@torch.inference_mode()
def reference_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    """transformers' logprob of each prompt token after the first."""
    logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def assert_tp2_greedy_parity(path: str, ref_model, batch: list[list[int]], new_tokens: int):
    """Tensor parallelism 2 (fp32) gives transformers' greedy tokens on `batch`."""
    from folio import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    try:
        outs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
    finally:
        llm.shutdown()
    for ids, out in zip(batch, outs):
        ref, gaps = reference_greedy(ref_model, ids, new_tokens, ())
        assert_greedy_parity(out.outputs[0].token_ids, ref, gaps, label=f"tp2 {len(ids)}")


def assert_prefix_hit_parity(path: str, ref_model, new_tokens: int):
    """A prompt that shares 48 tokens with an earlier one hits the prefix cache
    (blocks of 8) and still gives transformers' greedy tokens."""
    import random

    from folio import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    shared = [random.Random(3).randrange(5, 384) for _ in range(48)]
    first, second = shared + [7, 8, 9], shared + [11, 12]
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=8)
    llm.generate({"prompt_token_ids": first}, params, use_tqdm=False)
    out = llm.generate({"prompt_token_ids": second}, params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 48
    ref, gaps = reference_greedy(ref_model, second, new_tokens, ())
    assert_greedy_parity(out.outputs[0].token_ids, ref, gaps, label="prefix hit")


def assert_windowed_greedy_parity(llm, ref_model, prompts: list[list[int]], new_tokens: int,
                                  label: str = "") -> None:
    """A windowed model's greedy tokens are transformers' for `prompts` (longer
    than its window) one at a time, then for a prompt that shares 48 tokens
    with an earlier one and hits the prefix cache (blocks of 8)."""
    import random

    from folio import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for ids in prompts:
        ref, gaps = reference_greedy(ref_model, ids, new_tokens, ())
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
        assert_greedy_parity(out.token_ids, ref, gaps, label=f"{label} {len(ids)}")
    shared = [random.Random(3).randrange(5, 384) for _ in range(48)]
    llm.generate({"prompt_token_ids": shared + [7, 8, 9]}, params, use_tqdm=False)
    second = shared + [11, 12]
    out = llm.generate({"prompt_token_ids": second}, params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 48
    ref, gaps = reference_greedy(ref_model, second, new_tokens, ())
    assert_greedy_parity(out.outputs[0].token_ids, ref, gaps, label=f"{label} prefix hit")


def assert_window_matters(llm, ref_model, ids: list[int], window: int) -> None:
    """Prompt logprobs equal transformers' with the windows; the same engine
    with every window taken off agrees before the window fills and parts
    after (so the window was what made them equal)."""
    expected = reference_prompt_logprobs(ref_model, ids)
    got = prompt_logprobs(llm, ids)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    for layer in llm.engine.executor.runner.model.model.layers:
        layer.self_attn.attn.sliding_window = None
    llm.engine.scheduler.kv.window = None           # every block kept, to read them all
    unwindowed = prompt_logprobs(llm, ids)
    assert torch.allclose(unwindowed[:window - 1], expected[:window - 1], atol=1e-4)
    assert (unwindowed - expected).abs().max() > 1e-2


def assert_batched_parity_under_preemption(path: str, ref_model, batch: list[list[int]],
                                           new_tokens: int, blocks: int, backend: str) -> None:
    """`batch` at once in `blocks` blocks of 4, 32 tokens a step and 4 seats,
    so that sequences are preempted: every one still gives transformers'
    greedy tokens, and every block comes back."""
    from folio import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm = LLM(path, dtype="float32", num_kv_blocks=blocks, block_size=4,
              max_num_batched_tokens=32, max_num_seqs=4, attention_backend=backend)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
    for ids, out in zip(batch, outs):
        ref, gaps = reference_greedy(ref_model, ids, new_tokens, ())
        assert_greedy_parity(out.outputs[0].token_ids, ref, gaps, label=out.request_id)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.kv.num_free_blocks == blocks


def windowed_prompts(n: int, seed: int, window: int) -> list[list[int]]:
    """n random prompts of window + 5 to 80 tokens (past the window)."""
    import random
    rng = random.Random(seed)
    return [[rng.randrange(5, 384) for _ in range(rng.randint(window + 5, 80))]
            for _ in range(n)]

