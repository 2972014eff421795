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
from folio.core.beam import step_beams
from folio.core.outputs import (EngineCoreOutput, ModelRunnerOutput, ScheduledSeq,
                                SchedulerOutput)
from folio.core.seq_inputs import fork_children, prompt_targets, sampling_info
from folio.core.spec_decode import SpecDecodeCounts
from folio.core.spec_scheduling import SpecScheduling
from folio.request import PLACEHOLDER, Request, RequestStatus, Sequence, next_seq_id


class Scheduler:
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
        self._resend_table: set[int] = set()   # seq ids whose blocks were trimmed
        # speculative decoding's part (core/spec_scheduling.py), with its totals
        self.spec = (SpecScheduling(config, self.kv, self._seqs, self._resend_table)
                     if config.speculative is not None else None)
        # --async-scheduling: a sampled sequence gets a PLACEHOLDER token at once,
        # so the next step can be scheduled before this one returns
        self.ahead = config.async_scheduling and config.speculative is None
        self.num_not_ahead = 0         # requests that must wait for their tokens
        self._preempted_now: set[str] = set()   # preempted by this schedule call

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

    @property
    def spec_counts(self) -> SpecDecodeCounts:
        """Speculative decoding's totals: proposal runs, tokens proposed, accepted."""
        return self.spec.counts if self.spec is not None else SpecDecodeCounts()

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
                req.draft_eligible = self.spec is None or self.spec.draft_eligible(
                    len(self.running), len(self.waiting))
            self.running.append(req)
            budget -= self._emit(out, req, self._chunk(req, budget), grants)
        if self.spec is not None:
            self.spec.attach_proposals(out, budget, len(self.running))
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
        # (an embedding request pooling more than its last position computes them all)
        uses_cache = req.params.prompt_logprobs is None and (
            req.pooling is None or req.pooling.pooling == "last")
        if len(seqs) == 1 and uses_cache:
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
        if len(seqs) == 1 and uses_cache:
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
                    req.params.keeps_history or (self.spec is not None
                                                 and self.spec.drafts_for(req))) else None)))
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

    # ---- after a step ---------------------------------------------------------
    # The runner's tokens appended to their sequences, the blocks whose tokens
    # are all computed published to the prefix cache, forks made, beams
    # advanced, stops and limits applied, failed sequences ended with their
    # error, finished requests' blocks returned; what each request produced,
    # as EngineCoreOutputs.
    def update_from_output(self, sched_out: SchedulerOutput,
                           runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = [EngineCoreOutput(r.request_id, s.index, [], [], s.finish_reason)
                   for r in self.finished_by_capacity for s in r.seqs]
        self.finished_by_capacity = []
        # First, so that a failed sequence's uncomputed blocks are never cached.
        outputs += self._fail_requests(runner_out.failed)
        speculated = {s.seq_id: s for s in sched_out.seqs if s.spec_token_ids}
        self._cache_computed_blocks(sched_out, speculated)
        self._fork_new_children(runner_out)
        by_seq: dict[int, EngineCoreOutput] = {}
        for seq_id, scored in runner_out.prompt_logprobs.items():
            entry = self._seqs.get(seq_id)
            if entry is not None:
                by_seq[seq_id] = EngineCoreOutput(entry[0].request_id, entry[1].index, [], [],
                                                  prompt_logprobs=scored)
        touched: dict[str, Request] = {}   # requests a sequence of which ended
        for seq_id, vector in runner_out.pooled.items():    # embedding requests: done
            entry = self._seqs.get(seq_id)
            if entry is None or entry[1].status.is_finished:   # aborted after scheduling
                continue
            req, seq = entry
            self._finish_seq(seq, RequestStatus.FINISHED_STOPPED)
            by_seq[seq_id] = EngineCoreOutput(req.request_id, seq.index, [], [], "stop",
                                              pooled=vector)
            touched[req.request_id] = req
        beam_tops: dict[str, dict[int, list]] = {}
        ended: set[int] = set()           # ended by a token of this step: its later ones go
        kept: dict[int, int] = {}         # tokens each sequence took this step
        entries: dict[int, int] = {}      # tokens the runner gave each that proposed
        if speculated:
            for seq_id in runner_out.seq_ids:
                entries[seq_id] = entries.get(seq_id, 0) + 1
        tops = runner_out.top_logprobs or [None] * len(runner_out.seq_ids)
        for seq_id, token, logprob, top in zip(runner_out.seq_ids, runner_out.token_ids,
                                               runner_out.logprobs, tops):
            if seq_id in ended:
                continue
            entry = self._seqs.get(seq_id)
            if entry is None or entry[1].status.is_finished:   # aborted after scheduling
                by_seq.pop(seq_id, None)
                continue
            req, seq = entry
            if req.beam is not None:
                beam_tops.setdefault(req.request_id, {})[seq_id] = top
                continue
            if seq.placeholders:        # --async-scheduling: its place is kept
                seq.token_ids[len(seq.token_ids) - seq.placeholders] = token
                seq.placeholders -= 1
            else:
                seq.token_ids.append(token)
            seq.cumulative_logprob += logprob
            if speculated:
                kept[seq_id] = kept.get(seq_id, 0) + 1
            status = self._stop_status(req, seq, token)
            out = by_seq.get(seq_id)
            if out is None:
                out = by_seq[seq_id] = EngineCoreOutput(req.request_id, seq.index, [], [])
            out.new_token_ids.append(token)
            out.new_logprobs.append(logprob)
            if status is not None:
                if seq_id in speculated:    # what it computed, published before it goes
                    self.kv.cache_full_blocks(seq_id, seq.token_ids,
                                              speculated[seq_id].start_pos + kept[seq_id])
                self._finish_seq(seq, status)
                ended.add(seq_id)
                out.finish_reason, out.stop_reason = seq.finish_reason, seq.stop_reason
                touched[req.request_id] = req
            if top is not None:
                out.new_top_logprobs = (out.new_top_logprobs or []) + [top]
        if speculated:
            self.spec.keep_accepted(speculated, kept, entries)
        for rid, beam in beam_tops.items():
            try:
                outputs.extend(self._beam_step(self.requests[rid], beam))
            except Exception as e:      # noqa: BLE001 - this request's fault, not the engine's
                outputs.append(self._fail(self.requests[rid], f"{type(e).__name__}: {e}"))
        for req in touched.values():
            if not req.live_seqs:
                self._end_request(req, RequestStatus.FINISHED_STOPPED)
        self.waste.record(*self.kv.waste((s.seq_id, r.num_computed_tokens)
                                         for r in self.running for s in r.kv_seqs))
        return outputs + list(by_seq.values())

    # ---- after a step: helpers -----------------------------------------------

    def _fail_requests(self, failed: dict[int, str]) -> list[EngineCoreOutput]:
        """End the requests whose sequences failed in the runner; the rest of
        the batch goes on."""
        outputs = []
        for seq_id, error in failed.items():
            entry = self._seqs.get(seq_id)
            if entry is not None and entry[0].request_id in self.requests:
                outputs.append(self._fail(entry[0], error))
        return outputs

    def _fail(self, req: Request, error: str) -> EngineCoreOutput:
        self._end_request(req, RequestStatus.FINISHED_ERROR)
        return EngineCoreOutput(req.request_id, 0, [], [], "error", error=error)

    def _beam_step(self, req: Request, tops: dict[int, list]) -> list[EngineCoreOutput]:
        def fork(parent: Sequence, token: int, score: float) -> Sequence:
            child = Sequence(next_seq_id(), len(req.seqs), req.prompt_token_ids, parent.seed)
            child.token_ids = parent.token_ids + [token]
            child.cumulative_logprob = score
            child.status = RequestStatus.RUNNING
            self.kv.fork(parent.seq_id, child.seq_id)
            req.seqs.append(child)
            self._seqs[child.seq_id] = (req, child)
            return child

        def drop(seq: Sequence) -> None:
            self._finish_seq(seq, RequestStatus.FINISHED_ABORTED)

        state = req.beam
        step_beams(state, req.live_seqs, tops, req.eos_token_ids, fork, drop)
        if not state.done:
            return []
        self._end_request(req, RequestStatus.FINISHED_ABORTED)   # drops the live beams
        req.status = RequestStatus.FINISHED_STOPPED
        return [EngineCoreOutput(req.request_id, 0, [], [], "stop", beams=state.finished)]

    def _cache_computed_blocks(self, sched_out: SchedulerOutput,
                               speculated: dict[int, ScheduledSeq]) -> None:
        for s in sched_out.seqs:
            entry = self._seqs.get(s.seq_id)
            if entry is not None and not entry[1].status.is_finished \
                    and s.seq_id not in speculated:      # those once verified
                self.kv.cache_full_blocks(s.seq_id, entry[1].token_ids,
                                          s.start_pos + len(s.token_ids))

    def _fork_new_children(self, runner_out: ModelRunnerOutput) -> None:
        for seq_id in runner_out.seq_ids:
            entry = self._seqs.get(seq_id)
            if entry is None or entry[0].forked or entry[1].index == 0:
                continue
            req, child = entry
            if req.seqs[0].seq_id in self.kv.tables and not child.status.is_finished:
                self.kv.fork(req.seqs[0].seq_id, child.seq_id)
                self._started.add(child.seq_id)   # the runner copied the table itself
            if child is req.seqs[-1]:
                req.forked = True

    def _stop_status(self, req: Request, seq: Sequence, token: int) -> Optional[RequestStatus]:
        p = req.params
        ahead = seq.placeholders        # tokens of a step still running: not yet had
        if seq.num_output_tokens - ahead < p.min_tokens:
            pass                        # EOS and stop ids were masked out by the sampler
        elif not p.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        elif token in p.stop_token_ids:
            seq.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if p.max_tokens is not None and seq.num_output_tokens - ahead >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(seq.token_ids) - ahead >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish_seq(self, seq: Sequence, status: RequestStatus) -> None:
        seq.status = status
        if seq.placeholders:            # a step still running samples past its end
            del seq.token_ids[-seq.placeholders:]
            seq.placeholders = 0
        self.kv.free(seq.seq_id)
        self._started.discard(seq.seq_id)
        self._resend_table.discard(seq.seq_id)
        if self.spec is not None:
            self.spec.forget(seq.seq_id)
        self._finished_seq_ids.append(seq.seq_id)

    def _end_request(self, req: Request, status: RequestStatus) -> None:
        """Take a request out of its queue, end its live sequences with `status`,
        and forget it; its status becomes the most final of its sequences'."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        for seq in req.live_seqs:
            self._finish_seq(seq, status)
        req.status = max(s.status for s in req.seqs)
        del self.requests[req.request_id]
        if not req.runs_ahead:
            self.num_not_ahead -= 1
        for seq in req.seqs:
            self._seqs.pop(seq.seq_id, None)
