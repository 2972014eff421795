"""What the runner is told about a sequence when the scheduler emits it:
sampling settings, prompt tokens to score, samples to fork. Pure functions of
the request, kept apart from the scheduling loop."""

from __future__ import annotations

from folio.core.outputs import SamplingInfo
from folio.request import Request, Sequence


def sampling_info(req: Request, seq: Sequence) -> SamplingInfo:
    p = req.params
    banned = () if not p.min_tokens else tuple(sorted(
        set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids))))
    return SamplingInfo(p, seq.seed, seq.num_prompt_tokens, banned, req.lora, req.pooling)


def prompt_targets(req: Request, seq: Sequence, start: int, num_new: int):
    """Prompt tokens to score in this chunk: each once (not again when a
    preempted request recomputes), for the first sequence only."""
    if req.params.prompt_logprobs is None or seq.index != 0:
        return None
    first = max(start, req.num_prompt_logprobs_done)
    end = min(start + num_new, seq.num_prompt_tokens - 1)
    if first >= end:
        return None
    req.num_prompt_logprobs_done = end
    # Rows first - start .. of the chunk score tokens first + 1 .. end.
    return [None] * (first - start) + seq.token_ids[first + 1:end + 1]


def fork_children(req: Request):
    """At the end of the shared prompt, the other samples are drawn from the
    same logits and then hold the prompt's blocks with the first one."""
    if req.forked:
        return None
    return [(s.seq_id, sampling_info(req, s)) for s in req.seqs[1:]]
