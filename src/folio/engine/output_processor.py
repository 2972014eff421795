"""Engine outputs -> user-facing text: incremental detokenization, stop strings,
RequestOutputs.

IncrementalDetokenizer turns a stream of generated token ids into text deltas.
Decoding the whole output after every token would cost O(length) per token, so
it decodes a small window instead:

    output ids:  ... [ context tokens ][ pending tokens ]   <- window
                      already emitted    not yet emitted

    delta = decode(window)[len(already emitted text of the window):]

The context (the last tokens that produced text) stays in the window because
some decoders render a token differently at the start of a decode call
(SentencePiece's Metaspace drops the leading space of the first token).

Text that may still change is held back. A multi-byte character can be split
across byte-level BPE tokens (an emoji is often 2-3 tokens); until its last
byte arrives the decoder renders the partial bytes as U+FFFD at the end of the
text. Trailing U+FFFD is therefore held until the next tokens either complete
the character or show the bytes were invalid (the U+FFFD is then followed by
other text and is final). `flush()` releases whatever is held when the
sequence ends, so the concatenated deltas equal `tokenizer.decode(output_ids)`.
The window only grows while text is held, a few tokens for real text (only a
stream of invalid bytes with nothing valid after them keeps it growing).
"""

from __future__ import annotations

import time

from typing import Optional, Sequence

from folio.core.outputs import EngineCoreOutput
from folio.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput,
                           RequestMetrics, RequestOutput)
from folio.request import Request

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Streams the text of one generated sequence, one delta per `add_tokens` call.

    `prompt_token_ids` are kept for callers (echo, logprobs) but are not decoded:
    the stream is defined as `decode(output_token_ids)`, which is also what
    transformers' generate-then-decode returns.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.prompt_token_ids = list(prompt_token_ids)
        self.skip_special_tokens = skip_special_tokens
        self._byte_tokens = getattr(tokenizer, "byte_fallback_ids", frozenset())
        self._skipped_ids = getattr(tokenizer, "all_special_ids", frozenset()) \
            if skip_special_tokens else frozenset()
        self.output_token_ids: list[int] = []
        self.text = ""
        self._window: list[int] = []    # context tokens + pending tokens
        self._num_context = 0           # leading window tokens that are context
        self._context_chars = 0         # len(decode(context tokens))
        self._sent_chars = 0            # chars of decode(window) already emitted

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Append generated ids; return the text that became final (may be "")."""
        if not new_ids:
            return ""
        self.output_token_ids.extend(new_ids)
        # Skipped special tokens add no text and do not even reach the decoder
        # (they do not close a byte-fallback run), so they stay out of the window.
        self._window.extend(t for t in new_ids if t not in self._skipped_ids)
        if len(self._window) == self._num_context:
            return ""
        window_text = self._decode(self._window)
        # All trailing U+FFFD are held, not just the last: SentencePiece's
        # ByteFallback decoder renders each byte of an unfinished run as one.
        stable = len(window_text.rstrip(_REPLACEMENT))
        run_start = self._open_byte_run_start()
        if run_start is not None:
            stable = min(stable, self._context_chars if run_start == self._num_context
                         else len(self._decode(self._window[:run_start])))
        delta = window_text[self._sent_chars:stable] if stable > self._sent_chars else ""
        self._sent_chars = max(self._sent_chars, stable)
        self.text += delta
        if stable == len(window_text):
            self._rotate(window_text)
        return delta

    def flush(self) -> str:
        """Release held-back text (call when the sequence finishes)."""
        if len(self._window) == self._num_context:
            return ""
        window_text = self._decode(self._window)
        delta = window_text[self._sent_chars:]
        self.text += delta
        self._rotate(window_text)
        return delta

    def _open_byte_run_start(self) -> Optional[int]:
        """Where a trailing run of byte-fallback tokens (<0xE2><0x82>...) starts.

        ByteFallback decodes a run of byte tokens as one unit, and if the run
        is not valid UTF-8 as a whole every byte becomes U+FFFD -- even a
        complete character at its start. Text from a run is final only once a
        non-byte token closes it.
        """
        start = None
        for k in range(len(self._window) - 1, self._num_context - 1, -1):
            if self._window[k] not in self._byte_tokens:
                break
            start = k
        return start

    def _rotate(self, window_text: str) -> None:
        """Everything decoded is final: the pending tokens become the new context."""
        if len(window_text) == self._context_chars:
            # The pending tokens produced no text (e.g. tokens that decode to
            # nothing): drop them, keeping the context, so the window stays small.
            del self._window[self._num_context:]
            self._sent_chars = self._context_chars
            return
        del self._window[:self._num_context]
        self._num_context = len(self._window)
        self._context_chars = len(self._decode(self._window))
        self._sent_chars = self._context_chars

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)



class _SeqText:
    """Text of one sequence: detokenized incrementally, cut at a stop string."""

    def __init__(self, detok: IncrementalDetokenizer):
        self.detok = detok
        self.text = ""
        self.token_ids: list[int] = []
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[int | str] = None
        self.cumulative_logprob = 0.0
        self.logprobs: Optional[list[dict[int, float]]] = None
        self.score: Optional[float] = None


class _RequestState:
    def __init__(self, request: Request, prompt: Optional[str], tokenizer,
                 final_only: bool = False):
        self.request = request
        # final_only: only the finished RequestOutput is wanted (offline
        # LLM.generate), so none is built before; without stop strings the
        # text is then decoded once, when the sequence ends
        self.final_only = final_only
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.error: Optional[str] = None
        p = request.params
        self.stop = p.stop
        self.text_at_end = final_only and not p.stop
        self.include_stop = p.include_stop_str_in_output
        self.min_tokens = p.min_tokens
        self.seqs = [_SeqText(IncrementalDetokenizer(tokenizer, request.prompt_token_ids,
                                                     p.skip_special_tokens))
                     for _ in request.seqs]
        if p.logprobs is not None:
            for seq in self.seqs:
                seq.logprobs = []
        # Position 0 has no logprob: nothing precedes it.
        self.prompt_logprobs = [None] if p.prompt_logprobs is not None else None
        self.embedding = request.pooling is not None    # an embedding request
        self.pooled: Optional[list[float]] = None

    def set_beams(self, beams, tokenizer) -> None:
        """A finished beam search: its hypotheses, best first, become the outputs."""
        eos = self.request.eos_token_ids
        self.seqs = []
        for h in beams:
            seq = _SeqText(None)
            seq.token_ids = list(h.token_ids)
            ends_with_eos = bool(h.token_ids) and h.token_ids[-1] in eos
            text_ids = h.token_ids[:-1] if ends_with_eos else h.token_ids
            seq.text = tokenizer.decode(text_ids, skip_special_tokens=True)
            seq.cumulative_logprob = h.cumulative_logprob
            seq.finish_reason = "stop" if ends_with_eos else "length"
            seq.score = h.score
            self.seqs.append(seq)

    def catch_up_text(self) -> None:
        """Text decoded at the end only: the unfinished sequences' text so far
        (an abort or a failure ends them without a last token)."""
        if self.text_at_end:
            for seq in self.seqs:
                if seq.finish_reason is None and seq.detok is not None:
                    seq.text = seq.detok.add_tokens(seq.token_ids) + seq.detok.flush()

    def fail(self, error: str) -> None:
        """The request failed inside a step: every unfinished sequence ends."""
        self.error = error
        self.catch_up_text()
        for seq in self.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "error"

    def add_prompt_logprobs(self, scored) -> None:
        for logprob, top in scored:
            token = self.prompt_token_ids[len(self.prompt_logprobs)]
            self.prompt_logprobs.append({token: logprob, **dict(top)})

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def output(self) -> RequestOutput | EmbeddingRequestOutput:
        if self.embedding:
            m = self.metrics
            m.first_scheduled_time = self.request.first_scheduled_time
            if self.finished and m.finished_time is None:
                m.finished_time = time.monotonic()
            return EmbeddingRequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                                          EmbeddingOutput(self.pooled or [],
                                                          self.seqs[0].finish_reason),
                                          finished=self.finished, metrics=m,
                                          num_cached_tokens=self.request.num_cached_tokens,
                                          error=self.error)
        outs = [CompletionOutput(i, s.text, list(s.token_ids), s.cumulative_logprob,
                                 s.finish_reason, s.stop_reason,
                                 None if s.logprobs is None else list(s.logprobs), s.score)
                for i, s in enumerate(self.seqs)]
        finished = self.finished
        m = self.metrics
        m.first_scheduled_time = self.request.first_scheduled_time
        if finished and m.finished_time is None:
            m.finished_time = time.monotonic()
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs,
                             finished=finished, prompt_logprobs=self.prompt_logprobs,
                             metrics=m, num_preemptions=self.request.num_preemptions,
                             num_cached_tokens=self.request.num_cached_tokens,
                             error=self.error)


class OutputProcessor:
    """Core outputs -> RequestOutputs (cumulative text and tokens per sequence).

    The token that ended a sequence by EOS or a stop token id stays in
    `token_ids` but adds no text. Stop strings are found across token
    boundaries: the search restarts max(len(stop)) - 1 characters back.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}

    def add_request(self, request: Request, prompt: Optional[str],
                    final_only: bool = False) -> None:
        """`final_only`: `process` returns the request's output once, finished
        (and skips the incremental text where no stop string needs it)."""
        self.states[request.request_id] = _RequestState(request, prompt, self.tokenizer,
                                                        final_only)

    def process(self, core_outputs: list[EngineCoreOutput]
                ) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        touched: dict[str, _RequestState] = {}
        stopped: list[tuple[str, int]] = []
        for co in self._token_by_token(core_outputs):
            state = self.states.get(co.request_id)
            if state is None:
                continue
            if co.beams is not None:
                state.set_beams(co.beams, self.tokenizer)
                touched[co.request_id] = state
                continue
            if co.error is not None:
                state.fail(co.error)
                touched[co.request_id] = state
                continue
            if co.pooled is not None:           # an embedding request: done
                state.pooled = co.pooled
                state.seqs[co.index].finish_reason = co.finish_reason or "stop"
                touched[co.request_id] = state
                continue
            if co.prompt_logprobs and state.prompt_logprobs is not None:
                state.add_prompt_logprobs(co.prompt_logprobs)
                touched[co.request_id] = state
            seq = state.seqs[co.index]
            if seq.finish_reason is not None or not (co.new_token_ids or co.finish_reason):
                continue
            if co.new_token_ids:
                now = time.monotonic()
                state.metrics.first_token_time = state.metrics.first_token_time or now
                state.metrics.last_token_time = now
            seq.token_ids.extend(co.new_token_ids)
            seq.cumulative_logprob += sum(co.new_logprobs)
            if seq.logprobs is not None:
                tops = co.new_top_logprobs or [[] for _ in co.new_token_ids]
                for token, logprob, top in zip(co.new_token_ids, co.new_logprobs, tops):
                    seq.logprobs.append({token: logprob, **dict(top)})
            ended_by_token = co.finish_reason == "stop"
            if state.text_at_end:       # the whole text at once, when it ends
                if co.finish_reason is not None:
                    out_ids = seq.token_ids[:-1] if ended_by_token else seq.token_ids
                    seq.text = seq.detok.add_tokens(out_ids) + seq.detok.flush()
                    seq.finish_reason, seq.stop_reason = co.finish_reason, co.stop_reason
                touched[co.request_id] = state
                continue
            new_ids = co.new_token_ids[:-1] if ended_by_token else co.new_token_ids
            delta = seq.detok.add_tokens(new_ids)
            if co.finish_reason is not None:
                delta += seq.detok.flush()
            if self._append_text(state, seq, delta):
                stopped.append((co.request_id, co.index))
            elif co.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = co.finish_reason, co.stop_reason
            touched[co.request_id] = state
        outputs = []
        for rid, state in touched.items():
            if state.final_only and not state.finished:
                continue
            out = state.output()
            if out.finished:
                del self.states[rid]
            outputs.append(out)
        return outputs, stopped

    def _token_by_token(self, core_outputs: list[EngineCoreOutput]):
        """Several tokens of a sequence in one step (accepted proposals) are
        taken one at a time where stop strings are watched, so that a stop
        inside the run ends the sequence at that token, as it would have ended
        had they come one step each."""
        for co in core_outputs:
            state = self.states.get(co.request_id)
            n = len(co.new_token_ids)
            if n < 2 or state is None or not state.stop or co.beams is not None:
                yield co
                continue
            tops = co.new_top_logprobs
            for i in range(n):
                last = i == n - 1
                yield EngineCoreOutput(
                    co.request_id, co.index, co.new_token_ids[i:i + 1], co.new_logprobs[i:i + 1],
                    co.finish_reason if last else None, co.stop_reason if last else None,
                    None if tops is None else tops[i:i + 1],
                    co.prompt_logprobs if i == 0 else None, error=co.error)

    def _append_text(self, state: _RequestState, seq: _SeqText, delta: str) -> bool:
        """Add text; True when a stop string ended the sequence."""
        if not state.stop or len(seq.token_ids) < state.min_tokens:
            seq.text += delta
            return False
        back = max(len(s) for s in state.stop) - 1
        start = max(0, len(seq.text) - back)
        seq.text += delta
        hits = [(seq.text.find(s, start), s) for s in state.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        i, s = min(hits)
        seq.text = seq.text[:i + len(s)] if state.include_stop else seq.text[:i]
        seq.finish_reason, seq.stop_reason = "stop", s
        return True

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for rid in request_ids:
            state = self.states.pop(rid, None)
            if state is None:
                continue
            state.catch_up_text()
            for seq in state.seqs:
                if seq.finish_reason is None:
                    seq.finish_reason = "abort"
            outputs.append(state.output())
        return outputs


def merge_steps(core_outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
    """Several steps' outputs, in order, as one step's: each sequence's runs of
    tokens joined into one output (where the first of them has not ended it),
    so that a front end that fell behind its core detokenizes each sequence
    once and makes one RequestOutput per request for them all. `process`
    still takes a stop string's sequence token by token, so a stop inside a
    joined run ends it where it would have ended step by step."""
    merged: list[EngineCoreOutput] = []
    at: dict[tuple[str, int], int] = {}       # (request, sequence) -> its place in merged
    for co in core_outputs:
        key = (co.request_id, co.index)
        k = at.get(key)
        before = None if k is None else merged[k]
        if (before is None or before.finish_reason is not None or before.beams is not None
                or before.error is not None or co.beams is not None or co.error is not None
                or co.pooled is not None):
            at[key] = len(merged)
            merged.append(co)
            continue
        tops = None
        if before.new_top_logprobs is not None or co.new_top_logprobs is not None:
            tops = ((before.new_top_logprobs or [[] for _ in before.new_token_ids])
                    + (co.new_top_logprobs or [[] for _ in co.new_token_ids]))
        prompt = None
        if before.prompt_logprobs is not None or co.prompt_logprobs is not None:
            prompt = (before.prompt_logprobs or []) + (co.prompt_logprobs or [])
        merged[k] = EngineCoreOutput(
            co.request_id, co.index, before.new_token_ids + co.new_token_ids,
            before.new_logprobs + co.new_logprobs, co.finish_reason, co.stop_reason,
            tops, prompt)
    return merged

