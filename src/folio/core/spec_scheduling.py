"""The scheduler's part in speculative decoding (core/spec_decode.py): which
decodes carry proposals and how many, attached once the step's other work
has its tokens and slots; and, after the step, the accepted proposals kept
as computed tokens, the slots of rejected ones returned. A collaborator of
the Scheduler with state of its own (the totals, the n-gram proposer and
its index); it reads the scheduler's KV manager and sequences, given when
it is made, and adds to the set of tables the scheduler resends."""

from __future__ import annotations

from folio.config import SchedulerConfig
from folio.core.kv_cache_manager import KVCacheManager
from folio.core.outputs import ScheduledSeq, SchedulerOutput
from folio.core.spec_decode import DRAFT_PLACEHOLDER, NgramProposer, SpecDecodeCounts
from folio.request import Request, Sequence


class SpecScheduling:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 seqs: dict[int, tuple[Request, Sequence]], resend_table: set[int]):
        self.config = config
        self.spec = config.speculative
        self.kv, self._seqs, self._resend_table = kv, seqs, resend_table
        # proposal runs verified, tokens proposed and accepted, all steps
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.proposer = (NgramProposer(self.spec.prompt_lookup_max, self.spec.prompt_lookup_min)
                         if self.spec.method == "ngram" else None)

    @property
    def counts(self) -> SpecDecodeCounts:
        return SpecDecodeCounts(self.num_drafts, self.num_draft_tokens,
                                self.num_accepted_tokens)

    def forget(self, seq_id: int) -> None:
        """A sequence ended: the proposer's index of it goes."""
        if self.proposer is not None:
            self.proposer.forget(seq_id)

    def attach_proposals(self, out: SchedulerOutput, budget: int, num_running: int) -> None:
        """Speculative decoding, once every decode, prompt chunk and admission
        of the step has its tokens and slots: proposals ride on decodes with
        the budget and the free blocks left, so they never take what another
        sequence needs, and never preempt. A decode with proposals becomes one
        span, [its token] + proposals (ScheduledSeq.spec_token_ids)."""
        for s in out.seqs:
            if budget <= 0:
                return
            entry = self._seqs.get(s.seq_id)
            if entry is None or len(s.token_ids) != 1 or not s.sample \
                    or s.prompt_targets is not None or s.fork_children:
                continue
            req, seq = entry
            drafts = self._proposals(req, budget, num_running)
            if not drafts:
                continue
            first = s.start_pos + 1
            grants = self.kv.allocate_slots([s.seq_id], first, first + len(drafts))
            if grants is None:
                continue
            (grant,) = grants
            if grant.copy is not None:
                out.blocks_to_copy.append(grant.copy)
            s.new_block_ids = s.new_block_ids + grant.new_block_ids
            if s.block_ids is not None or grant.copy is not None:
                s.block_ids = self.kv.block_ids(s.seq_id)
            s.token_ids = s.token_ids + drafts
            s.spec_token_ids = drafts
            budget -= len(drafts)

    def draft_eligible(self, num_running: int, num_waiting: int) -> bool:
        """Whether a request being admitted will take a draft model's
        proposals: only if the requests running and waiting with it are within
        disable_by_batch_size (or max_num_seqs, if fewer: no more can run). The
        draft sees a sequence only when it proposes
        and then catches up on every token before (a prefill of the draft); a
        request that arrives to more load than that would pay that prefill
        late, for the few decodes it gets once the batch has shrunk."""
        spec = self.spec
        if spec.method != "draft_model" or spec.disable_by_batch_size is None:
            return True
        load = min(num_running + num_waiting + 1, self.config.max_num_seqs)
        return load <= spec.disable_by_batch_size

    def drafts_for(self, req: Request) -> bool:
        """Whether a draft model may propose for `req` (the runner's draft then
        needs the tokens before a prefix hit, to catch up where the cache lacks
        its keys and values)."""
        return self.spec.method == "draft_model" and req.draft_eligible and len(req.seqs) == 1

    def _proposals(self, req: Request, budget: int, num_running: int) -> list[int]:
        """Tokens proposed after a decode's token (speculative decoding), within
        what the request may still produce and `budget`. Requests of one
        sequence (the runner gives each proposal row the tokens before it, for
        penalties, min_tokens and grammars), without prompt logprobs, and no
        seeded sampled ones: a seed gives the same text whatever else runs,
        and whether a step carries proposals depends on what else runs."""
        spec = self.spec
        if req.beam is not None or len(req.seqs) != 1 or not req.draft_eligible:
            return []
        if spec.disable_by_batch_size is not None and num_running > spec.disable_by_batch_size:
            return []
        p = req.params
        if p.prompt_logprobs is not None or \
                (not p.greedy and p.seed is not None):
            return []
        if req.spec_wait > 0:           # backing off after rejected runs
            req.spec_wait -= 1
            return []
        seq = req.seqs[0]
        k = min(spec.num_speculative_tokens, budget,
                self.config.max_model_len - len(seq.token_ids) - 1)
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - seq.num_output_tokens - 1)
        if k <= 0:
            return []
        if self.proposer is None:       # a draft model's, made by the runner
            return [DRAFT_PLACEHOLDER] * k
        return self.proposer.propose(seq.seq_id, seq.token_ids, k)

    def keep_accepted(self, speculated: dict[int, ScheduledSeq], kept: dict[int, int],
                       entries: dict[int, int]) -> None:
        """Sequences that carried proposals: the accepted ones are computed
        tokens now (their keys and values were written by the step); the slots
        of rejected ones are free for the next step to overwrite, and blocks
        wholly past them go back to the pool. Only then are full blocks
        published, so the prefix cache never sees a rejected token. (The
        runner gave each the accepted proposals and one token after them.)"""
        for seq_id, s in speculated.items():
            if not entries.get(seq_id):
                continue                # failed or aborted: nothing was verified
            self.num_drafts += 1
            self.num_draft_tokens += len(s.spec_token_ids)
            self.num_accepted_tokens += entries[seq_id] - 1
            entry = self._seqs.get(seq_id)
            if entry is None or entry[1].status.is_finished:
                continue
            req, seq = entry
            # a run wholly rejected: the next 2, 4, .. 32 decodes go without
            # proposals (a request whose own choices do not repeat its text,
            # sampled at a high temperature say, stops paying for rows it throws
            # away); any accepted proposal resets the wait
            req.spec_misses = req.spec_misses + 1 if entries[seq_id] == 1 else 0
            req.spec_wait = min(1 << req.spec_misses, 32) if req.spec_misses else 0
            accepted = kept[seq_id] - 1
            req.num_computed_tokens += accepted
            # the next step writes the token just sampled, at num_computed
            if self.kv.trim(seq_id, req.num_computed_tokens + 1):
                self._resend_table.add(seq_id)
            self.kv.cache_full_blocks(seq_id, seq.token_ids, req.num_computed_tokens)
