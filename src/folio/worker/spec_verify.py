"""Verifying proposed tokens (speculative decoding, core/spec_decode.py) on
the rows the target model computed for them: a sequence with proposals
d1..dk has k + 1 rows, the model's distribution after its decode token and
after each proposal.

Greedy rows: d(i+1) stands when it is the model's own pick after row i, and
so does each pick after it (the model saw the tokens a decode step would
have); the sequence keeps t0..tj, the accepted proposals and the model's
token after them.

Sampled rows, rejection sampling (Leviathan et al., Chen et al.): a proposal
drawn from q is accepted with probability min(1, p(d) / q(d)); at the first
rejection the token comes from the residual max(0, p - q), normalized; when
every proposal stands, one more token comes from the last row's p. Each kept
token is then distributed as p, whatever the proposer. N-gram proposals are
deterministic (q is all on d): accept with probability p(d), and the
residual is p without d; a draft model's are drawn from its own q.
"""

from __future__ import annotations

from typing import Optional

import torch

from folio.model.layers import draws

from folio.core.outputs import ModelRunnerOutput


def verify_greedy(out: ModelRunnerOutput, proposals: dict[int, list[int]]) -> None:
    """A greedy sequence with proposals d1..dk has k + 1 consecutive entries in
    `out`, the model's picks t0..tk; the entries kept are t0..tj, j the count
    of leading proposals that equal the pick before them."""
    keep, i, n = [], 0, len(out.seq_ids)
    while i < n:
        seq_id, drafts = out.seq_ids[i], proposals.get(out.seq_ids[i])
        run = 1
        if drafts:
            while i + run < n and out.seq_ids[i + run] == seq_id:
                run += 1
            j = 0
            while j < min(len(drafts), run - 1) and out.token_ids[i + j] == drafts[j]:
                j += 1
            keep.extend(range(i, i + j + 1))
        else:
            keep.append(i)
        i += run
    if len(keep) < n:
        out.seq_ids = [out.seq_ids[x] for x in keep]
        out.token_ids = [out.token_ids[x] for x in keep]
        out.logprobs = [out.logprobs[x] for x in keep]
        if out.top_logprobs:
            out.top_logprobs = [out.top_logprobs[x] for x in keep]


def rejection_sample(probs: torch.Tensor, drafts: list[int], seed: int, first: int,
                     q: Optional[torch.Tensor] = None) -> list[int]:
    """Tokens kept for one sequence: probs [k + 1, V], the target's sampling
    distribution (temperature, top-k/p, min-p applied, rows summing to 1) after
    the decode token and after each of the k proposals; q [k, V], the
    distributions the proposals were drawn from (None: deterministic ones,
    q all on d). The draws are the sequence's (`seed`) at the positions of
    the tokens decided, `first` for the first proposal's (draws.py)."""
    kept = []
    for i, d in enumerate(drafts):
        u = draws.uniform(seed, first + i, draws.ACCEPT)
        q_d = 1.0 if q is None else float(q[i, d])
        if u * q_d < float(probs[i, d]):   # with probability min(1, p(d) / q(d))
            kept.append(d)
            continue
        if q is None:
            residual = probs[i].clone()
            residual[d] = 0
        else:
            residual = (probs[i] - q[i]).clamp_min(0)
        # (p no larger than q anywhere means p = q, which accepts: mass is left)
        kept.append(draws.draw_one(residual if residual.sum() > 0 else probs[i], seed,
                                   first + i, draws.RESIDUAL))
        return kept
    kept.append(draws.draw_one(probs[len(drafts)], seed, first + len(drafts), draws.SAMPLE))
    return kept
