"""Token-budget scheduling with continuous batching.

Every step each running request is given the tokens it needs to catch up with
its sequences (`num_tokens - num_computed_tokens`: a whole or partial prompt, a
recomputation after preemption, or one decode token), within
`max_num_batched_tokens` and `max_num_seqs`. Prefill, chunked prefill and decode
are thus one case, and prefills and decodes share a step. Waiting requests are
admitted, oldest first, the moment blocks and budget allow. When a running
request cannot get a block, the latest-admitted running request is preempted
(its blocks freed, its tokens kept to be recomputed later).
"""

from __future__ import annotations

import time
from typing import Iterable, Optional

from folio.config import SchedulerConfig
from folio.core.kv_cache_manager import KVCacheManager, SlotGrant, WasteStats, cdiv
from folio.core.request_queue import RequestQueue
from folio.core.outputs import ScheduledSeq, SchedulerOutput
from folio.core.seq_inputs import fork_children, prompt_targets, sampling_info
from folio.core.spec_decode import NgramProposer
from folio.core.spec_scheduling import SpecScheduling
from folio.core.step_results import StepResults
from folio.request import PLACEHOLDER, Request, RequestStatus, Sequence


class Scheduler(SpecScheduling, StepResults):
    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True, window: Optional[int] = None):
        self.config = config
        # window: every layer's (ModelConfig.kv_window), blocks behind it given back
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching, window)
        self.prefix_cache_queries = 0     # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0        # of which found
        self.waste = WasteStats()
        self.waiting = RequestQueue(config.scheduling_policy, config.priority_aging_steps)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._seqs: dict[int, tuple[Request, Sequence]] = {}
        self._started: set[int] = set()        # seq ids whose block table the runner holds
        self._finished_seq_ids: list[int] = []  # to tell the runner next step
        self.num_preemptions = 0
        # Requests the scheduler itself ended (cache too small): the engine reports them.
        self.finished_by_capacity: list[Request] = []
        # Speculative decoding: proposal runs, tokens proposed and accepted, all steps
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self._resend_table: set[int] = set()   # seq ids whose blocks were trimmed
        # --async-scheduling: a sampled sequence gets a PLACEHOLDER token at once,
        # so the next step can be scheduled before this one returns
        self.ahead = config.async_scheduling and config.speculative is None
        self.num_not_ahead = 0         # requests that must wait for their tokens
        self._preempted_now: set[str] = set()   # preempted by this schedule call
        spec = config.speculative
        self.proposer = (NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)
                         if spec is not None and spec.method == "ngram" else None)

    # ---- requests in and out -------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        # The prompt's blocks once, plus one copied block per extra sample or beam.
        copies = request.beam.params.beam_width if request.beam else len(request.seqs)
        need = self.kv.most_blocks(len(request.prompt_token_ids) + 1,
                                   self.config.max_num_batched_tokens) + copies - 1
        if need > self.kv.pool.num_blocks:
            raise ValueError(
                f"the request needs {need} KV blocks but the whole cache has "
                f"{self.kv.pool.num_blocks}: shorten the prompt or give the cache more memory")
        if (not self.config.enable_chunked_prefill
                and len(request.prompt_token_ids) > self.config.max_num_batched_tokens):
            raise ValueError(
                f"the prompt has {len(request.prompt_token_ids)} tokens, more than "
                f"max_num_batched_tokens ({self.config.max_num_batched_tokens}), and chunked "
                f"prefill is off: enable it or raise max_num_batched_tokens")
        self.requests[request.request_id] = request
        if not request.runs_ahead:
            self.num_not_ahead += 1
        for seq in request.seqs:
            self._seqs[seq.seq_id] = (request, seq)
        self.waiting.add(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            self._end_request(req, RequestStatus.FINISHED_ABORTED)
            aborted.append(req)
        return aborted

    def stop_sequences(self, stops: Iterable[tuple[str, int]]) -> None:
        """Finish single sequences (request id, index) found stopped outside the
        core, by a stop string; the request retires with its last sequence."""
        for rid, index in stops:
            req = self.requests.get(rid)
            if req is None or req.seqs[index].status.is_finished:
                continue
            self._finish_seq(req.seqs[index], RequestStatus.FINISHED_STOPPED)
            if not req.live_seqs:
                self._end_request(req, RequestStatus.FINISHED_STOPPED)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False (and nothing done) while requests hold blocks."""
        return self.kv.pool.reset_prefix_cache()

    def most_blocks(self, num_tokens: int) -> int:
        """The most blocks one sequence of `num_tokens` tokens holds at once."""
        return self.kv.most_blocks(num_tokens, self.config.max_num_batched_tokens)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- one step ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_seq_ids=self._finished_seq_ids, ahead=self.ahead)
        self._finished_seq_ids = []
        self._preempted_now.clear()
        self.waiting.tick()
        self._make_room_for_priority(out)
        budget = self.config.max_num_batched_tokens
        done: set[str] = set()          # requests scheduled (or gone) this step
        pressure = False
        # Decodes first, then prefill chunks: a long prompt never stalls a decode.
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue                # preempted earlier in this step
            num_new = self._chunk(req, budget)
            if num_new <= 0:
                continue
            grants = self._allocate(req, num_new)
            if grants is None and len(self.running) == 1 and req.seqs[0].placeholders:
                continue                # its token in flight first: it ends after that
            if grants is None and len(self.running) == 1:
                # Alone and still out of blocks: the whole cache is too small for
                # this sequence to grow; it ends here rather than loop forever.
                self._end_request(req, RequestStatus.FINISHED_LENGTH)
                self.finished_by_capacity.append(req)
                out.finished_seq_ids.extend(self._finished_seq_ids)
                self._finished_seq_ids = []
                break
            while grants is None:
                victim = self._victim(done)
                if victim is None:
                    break               # everyone else already runs this step: wait
                self._preempt(victim)
                out.num_preempted += 1
                pressure = True
                if victim is req:
                    break
                grants = self._allocate(req, num_new)
            if grants is None:
                continue
            budget -= self._emit(out, req, num_new, grants)
            done.add(req.request_id)
        # After a preemption there is no room to spare: admit nobody this step.
        while (self.waiting and budget > 0 and not pressure
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting.peek()
            if not self._lora_fits(req) or req.seqs[0].placeholders or (
                    self.ahead and req.request_id in self._preempted_now):
                # preempted with a step in flight: readmitted after its results
                # (update_from_output publishes that step's blocks by its table)
                break
            grants = self._admit(req, budget)
            if grants is None:
                break
            self.waiting.pop()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
                req.draft_eligible = self._draft_eligible()
            self.running.append(req)
            budget -= self._emit(out, req, self._chunk(req, budget), grants)
        if self.config.speculative is not None:
            self._attach_proposals(out, budget)
        return out

    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens per sequence this step: one to decode, else a prompt chunk."""
        remaining = req.num_tokens - req.num_computed_tokens
        per_seq = budget // len(req.kv_seqs)
        if remaining <= 1:
            return min(remaining, per_seq)
        cfg = self.config
        if not cfg.enable_chunked_prefill and req.kv_seqs[0].num_output_tokens == 0:
            return remaining if remaining <= per_seq else 0      # whole prompts only
        if cfg.long_prefill_token_threshold > 0:
            per_seq = min(per_seq, cfg.long_prefill_token_threshold)
        return min(remaining, per_seq)

    def _victim(self, scheduled: set[str]) -> Optional[Request]:
        """The running request to preempt: lowest priority, latest arrival, among
        those not already given tokens this step."""
        candidates = [r for r in self.running if r.request_id not in scheduled]
        return max(candidates, key=self.waiting.key) if candidates else None

    def _make_room_for_priority(self, out: SchedulerOutput) -> None:
        """Priority policy: a waiting request more urgent than running ones
        preempts them until its first chunk and a seat are free."""
        if self.waiting.policy != "priority" or not self.waiting:
            return
        head = self.waiting.peek()
        remaining = head.num_tokens - head.num_computed_tokens
        need = cdiv(min(remaining, self.config.max_num_batched_tokens), self.kv.block_size)
        while self.running and (self.kv.num_free_blocks < need
                                or len(self.running) >= self.config.max_num_seqs):
            victim = max(self.running, key=self.waiting.key)
            if self.waiting.key(victim) <= self.waiting.key(head):
                return
            self._preempt(victim)
            out.num_preempted += 1

    def _lora_fits(self, req: Request) -> bool:
        """Whether the running requests and `req` use at most max_loras
        distinct adapters (every step may then run them all). A request that
        would exceed it waits, and those behind it too (first come, first
        served)."""
        if req.lora is None or self.config.max_loras is None:
            return True
        running = {r.lora.lora_int_id for r in self.running if r.lora is not None}
        return req.lora.lora_int_id in running or len(running) < self.config.max_loras

    def _admit(self, req: Request, budget: int):
        """Blocks for a waiting request's next chunk, after taking what the prefix
        cache has for it; None (the cache left as it was) when they do not fit."""
        seqs = req.kv_seqs
        if req.lora is not None:
            for seq in seqs:
                self.kv.set_salt(seq.seq_id, ("lora", req.lora.lora_int_id))
        cached = 0
        if len(seqs) == 1 and req.params.prompt_logprobs is None:
            seq = seqs[0]
            # Whole blocks only, and never the last token: its logits are needed.
            cached = self.kv.attach_cached_prefix(seq.seq_id, seq.token_ids, req.num_tokens - 1)
        req.num_computed_tokens = cached
        num_new = self._chunk(req, budget)
        grants = self._allocate(req, num_new) if num_new > 0 else None
        if grants is None:
            if cached:
                self.kv.free(seqs[0].seq_id)
                req.num_computed_tokens = 0
            return None
        if len(seqs) == 1 and req.params.prompt_logprobs is None:
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += cached
        if req.num_cached_tokens is None:
            req.num_cached_tokens = cached
        return grants

    def _allocate(self, req: Request, num_new: int) -> Optional[list[SlotGrant]]:
        seq_ids = [s.seq_id for s in req.kv_seqs]
        for seq_id in seq_ids:      # (with a window: blocks no token from here reads)
            self.kv.drop_behind_window(seq_id, req.num_computed_tokens)
        return self.kv.allocate_slots(seq_ids, req.num_computed_tokens,
                                      req.num_computed_tokens + num_new)

    def _emit(self, out: SchedulerOutput, req: Request, num_new: int,
              grants: list[SlotGrant]) -> int:
        start = req.num_computed_tokens
        reaches_end = start + num_new == req.num_tokens
        seqs = req.kv_seqs
        started, resend_table = self._started, self._resend_table
        scored = req.params.prompt_logprobs is not None
        for seq, grant in zip(seqs, grants):
            seq_id = seq.seq_id
            fresh = seq_id not in started
            if grant.copy is not None:
                out.blocks_to_copy.append(grant.copy)
            resend = seq_id in resend_table
            if resend:
                resend_table.discard(seq_id)
            if not fresh and not resend and grant.copy is None and not scored:
                # a running sequence's next tokens (the common case: a decode)
                out.seqs.append(ScheduledSeq(
                    seq_id, seq.token_ids[start:start + num_new], start, grant.new_block_ids,
                    sample=reaches_end,
                    fork_children=fork_children(req) if reaches_end and not req.forked
                    else None))
                seq.status = RequestStatus.RUNNING      # (a forked child's first decode)
                continue
            out.seqs.append(ScheduledSeq(
                seq_id=seq_id,
                token_ids=seq.token_ids[start:start + num_new],
                start_pos=start,
                new_block_ids=grant.new_block_ids,
                block_ids=(self.kv.block_ids(seq_id)
                           if fresh or resend or grant.copy is not None else None),
                sampling=sampling_info(req, seq) if fresh else None,
                sample=reaches_end,
                prompt_targets=prompt_targets(req, seq, start, num_new),
                fork_children=fork_children(req) if reaches_end else None,
                history_prefix=(seq.token_ids[:start] if fresh and start and (
                    req.params.keeps_history or self._drafts_for(req)) else None)))
            started.add(seq_id)
            seq.status = RequestStatus.RUNNING
        if self.ahead and reaches_end and req.runs_ahead:
            self._placeholder(req, seqs[0])
        req.num_computed_tokens += num_new       # proposals count once accepted
        return num_new * len(seqs)

    def _placeholder(self, req: Request, seq: Sequence) -> None:
        """The token this step samples, in place until it returns, when a step
        after it will read it: not for the last token max_tokens or
        max_model_len allow."""
        p = req.params
        if ((p.max_tokens is None or seq.num_output_tokens + 1 < p.max_tokens)
                and len(seq.token_ids) + 1 < self.config.max_model_len):
            seq.token_ids.append(PLACEHOLDER)
            seq.placeholders += 1

    def _preempt(self, req: Request) -> None:
        self._preempted_now.add(req.request_id)
        self.running.remove(req)
        for seq in req.live_seqs:
            self.kv.free(seq.seq_id)
            self._started.discard(seq.seq_id)
            self._resend_table.discard(seq.seq_id)
            seq.status = RequestStatus.PREEMPTED
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(req)
