"""The scheduler's part after a step (a mixin of Scheduler, on its state:
running, waiting, requests, kv, _seqs, _started, _resend_table): the runner's
tokens appended to their sequences, the blocks whose tokens are all computed
published to the prefix cache, forks made, beams advanced, stops and limits
applied, failed sequences ended with their error, finished requests' blocks
returned; what each request produced, as EngineCoreOutputs."""

from __future__ import annotations

from typing import Optional

from folio.core.outputs import EngineCoreOutput, ModelRunnerOutput, ScheduledSeq, SchedulerOutput
from folio.core.beam import step_beams
from folio.request import Request, RequestStatus, Sequence, next_seq_id


class StepResults:
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
        self._keep_accepted(speculated, kept, entries)
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

    # ---- helpers -------------------------------------------------------------

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
        if self.proposer is not None:
            self.proposer.forget(seq.seq_id)
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
