"""Pipeline parallelism's step (--pipeline-parallel-size P, issue 33).

Every rank gets the same SchedulerOutput and prepares it as before (block
tables, sampling state on rank 0). The step's sequences, in the runner's
order, are cut into up to P micro-batches of about equal tokens (a sequence
is never split). Stage s takes each micro-batch's activations from stage
s - 1 (the same tensor-parallel rank of it), runs its layers on them, and
sends them on without waiting: while stage 1 runs micro-batch 0, stage 0
runs micro-batch 1. The last stage sends the final hidden states back to
stage 0, which holds the LM head and the sampler: it joins the micro-batches
in order and goes on as a single rank would. The micro-batches of one step
overlap; consecutive steps do not (a decode's next token needs this step's
sample), so with M micro-batches of a step a stage idles (P - 1) / (M + P - 1)
of it.

Point-to-point sends are torch.distributed's (gloo on CPU, NCCL on CUDA);
the receiver knows every shape from the step it prepared itself. The results
go back in a group of their own (stage 0's rank and the last stage's): NCCL
runs a pair's sends and receives on one stream in order, and at P = 2 the
way back would otherwise queue behind the next micro-batch going forward. A peer that
dies breaks the connection: the blocked receive raises (gloo reports a
closed peer at once; otherwise the collective timeout), and the executor
turns that into the engine's error.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from folio.config import FolioConfig
from folio.core.outputs import ScheduledSeq
from folio.model.pipeline import StagePlan

_FORWARD, _BACK = 1, 2         # message tags: activations down the pipe, results back


def stage_config(config: FolioConfig, plan: StagePlan) -> FolioConfig:
    """The config the KV cache is sized and allocated by: this stage's layers."""
    if plan.whole:
        return config
    return dataclasses.replace(config, model=dataclasses.replace(
        config.model, num_hidden_layers=len(plan.layers)))


def micro_batches(seqs: list[ScheduledSeq], count: int) -> list[list[ScheduledSeq]]:
    """`seqs` cut into at most `count` contiguous runs of about equal tokens."""
    count = min(count, len(seqs))
    total = sum(len(s.token_ids) for s in seqs)
    runs: list[list[ScheduledSeq]] = [[]]
    done = 0
    for i, s in enumerate(seqs):
        # start a new run once this one has its share, leaving a sequence for each run after
        left = len(seqs) - i
        if runs[-1] and len(runs) < count and (
                done >= total * len(runs) / count or left <= count - len(runs)):
            runs.append([])
        runs[-1].append(s)
        done += len(s.token_ids)
    return runs


class PipelineStage:
    """This rank's place in the pipe and its part of each step."""

    def __init__(self, runner, plan: StagePlan, tp_size: int, tp_rank: int):
        self.runner, self.plan = runner, plan
        self.prev = (plan.rank - 1) * tp_size + tp_rank
        self.next = (plan.rank + 1) * tp_size + tp_rank
        self.head = tp_rank                                  # stage 0's rank of my tp rank
        self.tail = (plan.size - 1) * tp_size + tp_rank      # the last stage's
        cfg = runner.model.config
        self.hidden_size, self.dtype = cfg.hidden_size, runner.dtype
        self.carried = runner.model.model.pp_tensors         # tensors passed between stages
        from folio.distributed.parallel_state import pipeline_back_group
        self.back = pipeline_back_group()

    @classmethod
    def build(cls, runner) -> Optional["PipelineStage"]:
        plan = runner.model.stage
        if plan.whole:
            return None
        from folio.distributed.parallel_state import tp_rank, tp_size
        return cls(runner, plan, tp_size(), tp_rank())

    def _recv(self, rows: int, count: int, src: int, tag: int, group=None
              ) -> list[torch.Tensor]:
        out = []
        for _ in range(count):
            t = torch.empty(rows, self.hidden_size, dtype=self.dtype, device=self.runner.device)
            dist.recv(t, src=src, tag=tag, group=group)
            out.append(t)
        return out

    def forward(self, ordered: list[ScheduledSeq]
                ) -> tuple[Optional[torch.Tensor], Optional[list[int]]]:
        """This stage's layers over the step's micro-batches; on stage 0 the
        final hidden states of every row, in `ordered`'s order, and each
        sequence's last row among them; (None, None) on the other stages."""
        runner, plan = self.runner, self.plan
        groups = micro_batches(ordered, plan.size)
        sending: list[tuple] = []                 # (work, tensor): alive until sent
        sizes, last_rows = [], []
        for group in groups:
            ids, step, rows = runner._describe(group)
            last_rows += [sum(sizes) + r for r in rows]
            sizes.append(len(ids))
            carried = None if plan.is_first else self._recv(len(ids), self.carried,
                                                            self.prev, _FORWARD)
            out = runner.model(runner._tensor(ids), runner._tensor(step.positions),
                               runner.kv_caches, runner.attn_backend.build_metadata(step),
                               carried)
            if plan.is_last:
                out = out.contiguous()
                sending.append((dist.isend(out, dst=self.head, tag=_BACK, group=self.back),
                                out))
            else:
                for t in out:
                    t = t.contiguous()
                    sending.append((dist.isend(t, dst=self.next, tag=_FORWARD), t))
        hidden = None
        if plan.is_first:
            hidden = torch.cat([self._recv(n, 1, self.tail, _BACK, self.back)[0]
                                for n in sizes])
        for work, _ in sending:
            work.wait()
        return (hidden, last_rows) if hidden is not None else (None, None)
