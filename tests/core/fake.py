"""A fake model runner for control-plane tests: no torch, deterministic tokens."""

from __future__ import annotations

from folio.core.outputs import ModelRunnerOutput, SchedulerOutput
from folio.request import Request, Sequence
from folio.sampling_params import SamplingParams


class FakeRunner:
    """Samples token (seq_id * 31 + position) % vocab for every sampled sequence,
    and checks that it is only ever asked for tokens in order."""

    def __init__(self, vocab: int = 1000):
        self.vocab = vocab
        self.seen: dict[int, int] = {}     # seq_id -> tokens the fake 'cache' holds
        self.steps = 0

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps += 1
        out = ModelRunnerOutput()
        for seq_id in so.finished_seq_ids:
            self.seen.pop(seq_id, None)
        for s in so.seqs:
            if s.block_ids is not None:    # (re)started: the runner's cache restarts here
                self.seen[s.seq_id] = s.start_pos
            assert self.seen[s.seq_id] == s.start_pos, "tokens scheduled out of order"
            self.seen[s.seq_id] += len(s.token_ids)
            if s.sample:
                pos = s.start_pos + len(s.token_ids)
                for seq_id in [s.seq_id] + [c for c, _ in s.fork_children or []]:
                    if seq_id != s.seq_id:
                        self.seen[seq_id] = pos     # the child starts with the parent's cache
                    out.seq_ids.append(seq_id)
                    out.token_ids.append((seq_id * 31 + pos) % self.vocab)
                    out.logprobs.append(-1.0)
        return out


_next_seq = [0]


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, n: int = 1,
                 eos: tuple[int, ...] = (), prompt: list[int] | None = None,
                 priority: int = 0, **params) -> Request:
    """Prompts differ between calls (no accidental prefix-cache hits) unless given."""
    seqs = []
    _next_seq[0] += 1
    if prompt is None:
        prompt = [(i * 7 + _next_seq[0] * 13) % 1000 for i in range(prompt_len)]
    for i in range(n):
        _next_seq[0] += 1
        seqs.append(Sequence(_next_seq[0], i, prompt, seed=i))
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, n=n, **params), seqs, eos,
                   priority=priority)


def step(sched, runner):
    """One scheduler step against the fake runner; returns the SchedulerOutput."""
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    return so


def drain(sched, runner, limit: int = 5000) -> None:
    for _ in range(limit):
        if not sched.has_unfinished_requests():
            return
        step(sched, runner)
    raise AssertionError("requests did not finish")
