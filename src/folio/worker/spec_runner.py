"""The runner's part in speculative decoding: a draft model's proposals made
before the step (worker/draft_proposer.py), a sampled sequence's proposals
verified by rejection sampling (worker/spec_verify.py), and accepted
proposals recorded where a sequence keeps its tokens. A collaborator of
ModelRunner (ModelRunner.spec): it holds the draft model (None for n-gram
proposals) and reads the runner's sequence states; what it needs of the
runner's sampling comes as the callables of `RowSampling`."""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple, Optional

import torch

from folio.core.outputs import ModelRunnerOutput, ScheduledSeq, describe_fault
from folio.model.layers.sampler import SamplingBatch, sampling_distribution
from folio.worker.spec_verify import rejection_sample

logger = logging.getLogger("folio")


class RowSampling(NamedTuple):
    """The runner's sampling, as speculative decoding uses it."""
    batch: Callable[..., SamplingBatch]     # (seq_ids, proposals=None) -> the rows' tensors
    constrain: Callable[..., None]          # (logits, seq_ids, proposals): grammars' masks
    check_fault: Callable[[list[int]], None]    # the tests' fault injection
    see: Callable[..., None]                # (state, tokens): a sequence's history grows


class SpecDecoding:
    def __init__(self, drafter, states: dict, sampling: RowSampling,
                 tensor_parallel_size: int):
        self.drafter = drafter          # worker/draft_proposer.py, or None
        self.states = states            # the runner's, by sequence id
        self.sampling = sampling
        self.tensor_parallel_size = tensor_parallel_size

    def record_accepted(self, out: ModelRunnerOutput, proposals: dict[int, list[int]]) -> None:
        """A sequence that keeps its tokens (a grammar's) takes the proposals it
        accepted into them: they were inputs of this step, not of the next."""
        kept: dict[int, int] = {}
        for seq_id in out.seq_ids:
            if seq_id in proposals:
                kept[seq_id] = kept.get(seq_id, 0) + 1
        for seq_id, n in kept.items():
            state = self.states[seq_id]
            if state.history is not None and n > 1:
                self.sampling.see(state, proposals[seq_id][:n - 1])

    def draft(self, ordered: list[ScheduledSeq]) -> dict[int, torch.Tensor]:
        """The draft model's proposals over the scheduler's placeholders (and
        the q a sampled sequence's were drawn from). Should the draft fail, the
        placeholders stay: proposals like any others, which the target rejects
        (its rows wasted, its tokens right)."""
        # Under tensor parallelism every rank runs the draft and must propose
        # alike, and only the driver samples: there a sampled request's
        # proposals are the draft's greedy picks (q all on d)
        sampled = {} if self.tensor_parallel_size > 1 else {
            s.seq_id: self.states[s.seq_id].sampling.seed for s in ordered
            if s.spec_token_ids and self.states[s.seq_id].random}
        try:
            return self.drafter.propose(ordered, sampled, self._draft_distribution)
        except Exception:               # noqa: BLE001 - the draft's, not the target's
            logger.exception("the draft model failed; this step's proposals are placeholders")
            return {}

    def _draft_distribution(self, seq_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """A draft model's rows under their sequences' sampling settings: what
        a sampled sequence's proposals are drawn from."""
        return sampling_distribution(logits, self.sampling.batch(seq_ids))[0]

    def verify_sampled(self, out: ModelRunnerOutput, logits: torch.Tensor,
                        s: ScheduledSeq, q: Optional[torch.Tensor] = None) -> None:
        """A sampled sequence's proposals, by rejection sampling against the
        distributions its k + 1 rows of logits give (worker/spec_verify.py); a
        failure fails this sequence alone."""
        k = len(s.spec_token_ids)
        try:
            self.sampling.check_fault([s.seq_id])
            self.sampling.constrain(logits, [s.seq_id] * (k + 1), {s.seq_id: s.spec_token_ids})
            probs, logprobs = sampling_distribution(
                logits, self.sampling.batch([s.seq_id] * (k + 1),
                                            {s.seq_id: s.spec_token_ids}))
            tokens = rejection_sample(probs, s.spec_token_ids, self.states[s.seq_id].sampling.seed,
                                      s.start_pos + len(s.token_ids) - k, q)
        except Exception as e:          # noqa: BLE001 - this sequence's fault
            out.failed[s.seq_id] = describe_fault(e)
            return
        want = self.states[s.seq_id].sampling.params.logprobs
        for i, token in enumerate(tokens):
            out.seq_ids.append(s.seq_id)
            out.token_ids.append(token)
            out.logprobs.append(float(logprobs[i, token]))
            if not want:
                out.top_logprobs.append(None if want is None else [])
            else:
                top, ids = logprobs[i].topk(want)
                out.top_logprobs.append(list(zip(ids.tolist(), top.tolist())))
