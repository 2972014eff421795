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


def assert_greedy_parity(ours: list[int], ref: list[int], gaps: list[float], label="") -> int:
    """Equal token for token, or equal up to a near-tie; returns tokens compared."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert gaps[i] < TIE_GAP, (
                f"{label}: token {i} differs ({a} vs reference {b}) with top-2 gap "
                f"{gaps[i]:.2e} >= {TIE_GAP}\nours: {ours}\nref:  {ref}")
            return i
    assert len(ours) == len(ref), f"{label}: lengths differ\nours: {ours}\nref:  {ref}"
    return len(ours)
