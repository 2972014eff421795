"""Logprobs of prompt tokens for the sequences that asked (echo, scoring,
prompt_logprobs): the runner's collaborator for a step's prompt chunks, on
the step's hidden states and the model's LM head."""

from __future__ import annotations

import torch

from folio.core.outputs import ModelRunnerOutput, ScheduledSeq, describe_fault


class PromptScorer:
    def __init__(self, model, device: torch.device, states: dict, tensor_parallel_size: int):
        self.model, self.device = model, device
        self.states = states          # the runner's, by sequence id (read: prompt_logprobs)
        self.tensor_parallel = tensor_parallel_size > 1

    def score(self, hidden, ordered, last_rows, out: ModelRunnerOutput) -> None:
        """Every scored chunk of the step into `out.prompt_logprobs`. Under
        tensor parallelism the LM head is collective: a fault there could
        strike one rank only, and the ranks would part ways, so it stays the
        engine's; otherwise it fails that sequence alone."""
        for s, last in zip(ordered, last_rows):
            if not s.prompt_targets:
                continue
            if self.tensor_parallel:
                out.prompt_logprobs[s.seq_id] = self._score(hidden, s, last)
                continue
            try:
                out.prompt_logprobs[s.seq_id] = self._score(hidden, s, last)
            except Exception as e:      # noqa: BLE001 - this sequence's fault
                out.failed[s.seq_id] = describe_fault(e)

    def _score(self, hidden, s: ScheduledSeq, last: int):
        first_row = last - len(s.token_ids) + 1
        picks = [(i, t) for i, t in enumerate(s.prompt_targets) if t is not None]
        rows = torch.tensor([first_row + i for i, _ in picks], device=self.device)
        logprobs = torch.log_softmax(self.model.compute_logits(hidden[rows]).float(), dim=-1)
        targets = torch.tensor([t for _, t in picks], device=self.device)
        chosen = logprobs.gather(-1, targets[:, None]).squeeze(-1).tolist()
        k = self.states[s.seq_id].sampling.params.prompt_logprobs or 0
        if k:
            top_lps, top_ids = logprobs.topk(k, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_lps.tolist())]
        else:
            tops = [[] for _ in picks]
        return list(zip(chosen, tops))
