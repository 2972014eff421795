"""A draft model's proposals (speculative decoding, method draft_model).

The scheduler gives a decode k slots after its token and placeholders for
them (core/spec_decode.py); before the step runs, the draft model fills them
with its greedy picks: one forward over each proposing sequence's tokens it
has not yet seen (up to and including the decode token), then k - 1 one-token
steps. The target then verifies [token, d1..dk] as it verifies any proposals.

The draft keeps its own paged KV cache, indexed by the target's block ids
(each block has the target's keys and values and the draft's; the runner
sizes the budget for both), so the scheduler's block tables serve it as
they are. It sees a sequence lazily: only when the sequence proposes, from
the first position it has not computed (`_DraftSeq.fed`). A prompt prefix
taken from the prefix cache is assumed to have the draft's keys and values
(written by the request that computed it, if that one ever proposed); where
it has not, proposals are worse, never the output, which the target alone
decides.

A greedy request's proposals are the draft's greedy picks. A sampled one's
are drawn from the draft's own distribution q under the request's sampling
settings (temperature, top-k/p, min-p: the runner's `distribution`), by the
request's seeded draws (model/layers/draws.py), and q goes to the rejection sampler, which accepts d
with probability min(1, p(d) / q(d)) (worker/spec_verify.py): the closer the
draft is to the target, the more stand, and every kept token is distributed
as the target's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from folio.config import FolioConfig
from folio.core.outputs import ScheduledSeq
from folio.model.attention.backend import StepDescription, to_device
from folio.model.layers import draws
from folio.model.layers.quantization.int_groups import set_activation_quantization
from folio.model.loader import iter_weights
from folio.model.registry import build_model
from folio.worker.kv_cache import allocate_kv_caches, bytes_per_block

logger = logging.getLogger("folio")


@dataclass
class _DraftSeq:
    base: int                       # the position of tokens[0]
    fed: int                        # positions below have the draft's keys and values
    table: list[int]                # the runner's block table of the sequence
    tokens: list[int] = field(default_factory=list)    # from `base` on, as the step gave them
    drafted: list[int] = field(default_factory=list)   # last step's proposals (d1..dk)

    @property
    def end(self) -> int:
        return self.base + len(self.tokens)


class DraftProposer:
    def __init__(self, config: FolioConfig, dtype: torch.dtype, attn_backend,
                 target_vocab_size: int):
        draft = config.scheduler.speculative.draft
        self.config, self.draft_config = config, draft
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.attn_backend = attn_backend
        self.model = build_model(draft, dtype, config.device, config.weight_dtype, attn_backend)
        self.model.load_weights(iter_weights(draft))
        set_activation_quantization(self.model, config.activation_quantization)
        self.model.build_native_decoder()
        # logits as wide as the target's: a wider draft vocabulary (padding)
        # never proposes an id the target lacks, a narrower one is padded
        self.target_vocab_size = target_vocab_size
        self.num_kv_heads = self.model.num_kv_heads_per_rank
        self.bytes_per_block = bytes_per_block(config, self.num_kv_heads, attn_backend, draft)
        self.kv_caches: list[torch.Tensor] = []
        self.seqs: dict[int, _DraftSeq] = {}
        # block ids whose every slot has the draft's keys and values of the
        # tokens it holds: a prefix-cache hit on them needs no catch-up
        self.written: set[int] = set()
        self.max_tokens = config.scheduler.max_num_batched_tokens   # per draft forward
        self.num_tokens_run = 0     # tokens through the draft model (tests, benchmarks)
        logger.info("draft model %s (%s, %s) proposes for speculative decoding",
                    draft.model, draft.architecture, draft.quantization or "float weights")

    def allocate(self, num_blocks: int) -> None:
        """The draft's cache: the same block ids as the target's."""
        self.kv_caches = allocate_kv_caches(self.config, num_blocks, self.num_kv_heads,
                                            self.attn_backend, self.draft_config)

    def observe(self, s: ScheduledSeq, table: list[int]) -> None:
        """A scheduled sequence's tokens of this step (not its placeholders),
        and its block table as the runner now holds it. A sequence that does
        not go on where it stopped (new, or resumed after preemption) starts
        again: blocks before its first position came from the prefix cache, and
        the draft has them where a sequence wrote them before; from the first
        one it has not, it catches up on the tokens the scheduler sent before
        that position (`history_prefix`)."""
        for b in s.new_block_ids or ():
            self.written.discard(b)
        d = self.seqs.get(s.seq_id)
        if d is not None and d.drafted:
            self._kept(d, s.start_pos - d.end)
        if d is None or s.start_pos != d.end:
            cached = s.start_pos // self.block_size
            for b in table[cached:]:
                self.written.discard(b)
            prefix = s.history_prefix or []
            if len(prefix) != s.start_pos:     # tokens before unknown: assume them there
                d = _DraftSeq(base=s.start_pos, fed=s.start_pos, table=table)
            else:
                have = 0
                while have < cached and table[have] in self.written:
                    have += 1
                d = _DraftSeq(base=0, fed=min(have * self.block_size, s.start_pos),
                              table=table, tokens=list(prefix))
            self.seqs[s.seq_id] = d
        d.table = table
        k = len(s.spec_token_ids or ())
        d.tokens.extend(s.token_ids[:len(s.token_ids) - k])

    def _advance(self, d: _DraftSeq, fed: int) -> None:
        """`fed` moves on: the blocks it has now passed are written."""
        bs = self.block_size
        for i in range(d.fed // bs, min(fed // bs, len(d.table))):
            self.written.add(d.table[i])
        d.fed = fed

    def copied(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of blocks (the runner copied the draft's caches too): a
        copy is written where its source was."""
        for a, b in pairs:
            (self.written.add if a in self.written else self.written.discard)(b)

    def forget(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)

    def _kept(self, d: _DraftSeq, j: int) -> None:
        """After a step with proposals, the sequence's next position says how
        many the target kept (the next token goes where the first one it did
        not keep was): those are its tokens now, and the draft's keys and
        values of the ones it was fed (d1..dk-1) stay. Read from the schedule,
        so that every tensor-parallel rank's draft keeps the same record
        without the driver's verdict."""
        if 0 < j <= len(d.drafted):
            d.tokens.extend(d.drafted[:j])
            self._advance(d, d.fed + min(j, len(d.drafted) - 1))
        d.drafted = []

    @torch.inference_mode()
    def propose(self, seqs: list[ScheduledSeq], seeds: dict[int, int],
                distribution: Callable[[list[int], torch.Tensor], torch.Tensor]
                ) -> dict[int, torch.Tensor]:
        """Write the draft's proposals over the placeholders of every sequence
        in `seqs` that has them (spec_token_ids and the tail of token_ids).
        Sequences in `seeds` sample theirs from `distribution(seq_ids,
        logits)`, with their draws at each proposal's position (draws.DRAFT);
        returned: each one's q, [k, V] over the target's vocabulary."""
        proposing = [s for s in seqs if s.spec_token_ids]
        if not proposing:
            return {}
        arrays = {s.seq_id: np.asarray(self.seqs[s.seq_id].table, dtype=np.int64)
                  for s in proposing}
        # first: every sequence from the first position the draft lacks to its
        # decode token (one-token spans first, as the backends want them)
        feeds = []
        for s in proposing:
            d = self.seqs[s.seq_id]
            first = min(d.fed, s.start_pos)
            feeds.append((s, first, d.tokens[first - d.base:s.start_pos + 1 - d.base]))
        feeds.sort(key=lambda f: len(f[2]) > 1)
        order = [s for s, _, _ in feeds]
        drafts: dict[int, list[int]] = {s.seq_id: [] for s in order}
        qs: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in order if s.seq_id in seeds}
        logits = self._run_spans([(first, toks, arrays[s.seq_id]) for s, first, toks in feeds])
        self._pick(order, logits, drafts, qs, seeds, distribution)
        # then one token at a time, for those that want more
        for i in range(1, max(len(s.spec_token_ids) for s in order)):
            more = [s for s in order if len(s.spec_token_ids) > i]
            logits = self._run([(s.start_pos + i, [drafts[s.seq_id][-1]], arrays[s.seq_id])
                                for s in more])
            self._pick(more, logits, drafts, qs, seeds, distribution)
        for s in order:
            d, mine = self.seqs[s.seq_id], drafts[s.seq_id]
            self._advance(d, s.start_pos + 1)
            d.drafted = mine
            s.spec_token_ids = mine
            s.token_ids = s.token_ids[:len(s.token_ids) - len(mine)] + mine
        return {seq_id: torch.stack(rows) for seq_id, rows in qs.items()}

    @staticmethod
    def _pick(seqs: list[ScheduledSeq], logits: torch.Tensor, drafts: dict, qs: dict,
              seeds: dict, distribution) -> None:
        """Each sequence's next proposal from its row of the draft's logits:
        the greedy pick, or a draw from q for a sampled sequence (all of
        them in one race, each at its proposal's position)."""
        picks = logits.argmax(dim=-1).tolist()
        rows = [i for i, s in enumerate(seqs) if s.seq_id in seeds]
        if rows:
            ids = [seqs[i].seq_id for i in rows]
            q = distribution(ids, logits[rows])
            keys = draws.keys_tensor([seeds[i] for i in ids],
                                     [seqs[i].start_pos + 1 + len(drafts[seqs[i].seq_id])
                                      for i in rows], draws.DRAFT, q.device)
            for j, (i, token) in enumerate(zip(rows, draws.race(q, keys).tolist())):
                picks[i] = token
                qs[ids[j]].append(q[j])
        for s, t in zip(seqs, picks):
            drafts[s.seq_id].append(t)

    def _run_spans(self, spans: list[tuple[int, list[int], np.ndarray]]) -> torch.Tensor:
        """The logits after each span's last token, the spans (a sequence's
        catch-up may be a whole prompt) run in forwards of at most
        max_num_batched_tokens tokens, a long one in pieces, in order."""
        rows: list[Optional[torch.Tensor]] = [None] * len(spans)
        batch: list[tuple[int, list[int], np.ndarray, Optional[int]]] = []
        count = 0

        def flush() -> None:
            nonlocal batch, count
            batch.sort(key=lambda b: len(b[1]) > 1)       # one-token spans first
            logits = self._run([b[:3] for b in batch])
            for row, b in zip(logits, batch):
                if b[3] is not None:
                    rows[b[3]] = row
            batch, count = [], 0
        for i, (start, toks, table) in enumerate(spans):
            pos = 0
            while pos < len(toks):
                take = min(len(toks) - pos, self.max_tokens - count)
                end = pos + take
                batch.append((start + pos, toks[pos:end], table,
                              i if end == len(toks) else None))
                count, pos = count + take, end
                if count >= self.max_tokens:
                    flush()
        if batch:
            flush()
        return torch.stack(rows)

    def _run(self, spans: list[tuple[int, list[int], np.ndarray]]) -> torch.Tensor:
        """One forward of the draft over the spans: the logits after each
        span's last token, [spans, the target's vocabulary] in fp32."""
        step, last_rows = StepDescription.of_spans(
            [(start, len(toks), table) for start, toks, table in spans],
            self.block_size, self.device)
        ids = np.asarray([t for _, toks, _ in spans for t in toks], dtype=np.int64)
        meta = self.attn_backend.build_metadata(step)
        hidden = self.model(to_device(ids, self.device), to_device(step.positions, self.device),
                            self.kv_caches, meta)
        self.num_tokens_run += len(ids)
        rows = torch.tensor(last_rows, device=self.device)
        logits = self.model.compute_logits(hidden[rows]).float()
        vocab = self.target_vocab_size
        if logits.shape[1] >= vocab:
            return logits[:, :vocab]
        return torch.nn.functional.pad(logits, (0, vocab - logits.shape[1]),
                                       value=float("-inf"))


def build_drafter(config: FolioConfig, dtype: torch.dtype, attn_backend,
                  target_vocab_size: int) -> Optional[DraftProposer]:
    spec = config.scheduler.speculative
    if spec is None or spec.method != "draft_model":
        return None
    return DraftProposer(config, dtype, attn_backend, target_vocab_size)
