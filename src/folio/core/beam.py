"""Beam search inside the engine, on shared KV blocks.

Every step, each live beam reports its top 2W token logprobs (W = beam width);
the 2W best continuations over all beams (beam score + logprob) are ranked.
Those that end (EOS, or the length limit) and rank among the first W become
finished hypotheses, scored sum_logprobs / generated_length ** length_penalty,
of which the W best are kept; the W best that do not end become the next live
beams. A parent chosen once carries on in place; chosen k times, it forks k - 1
new sequences that share its blocks by reference count (the block they write
next is copied on write); a parent not chosen is dropped and frees its blocks
at once. This follows transformers' beam search step for step, its stopping
rules included (early_stopping True, False or "never"), so the results match.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union


MAX_LENGTH_PENALTY = 10.0       # (2**20 tokens) ** 10 is still far inside a float's range


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False
    early_stopping: Union[bool, str] = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        # length ** penalty must stay a finite, non-zero float for any length.
        if not isinstance(self.length_penalty, (int, float)) or \
                not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY:
            raise ValueError(f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY}, "
                             f"{MAX_LENGTH_PENALTY}], got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError("early_stopping must be True, False or 'never'")


@dataclass
class Hypothesis:
    token_ids: list[int]        # generated tokens (EOS included when it ended one)
    score: float                # length-normalised, what the ranking uses
    cumulative_logprob: float


@dataclass
class BeamState:
    params: BeamSearchParams
    prompt_len: int
    max_len: int                              # prompt + max_tokens, within max_model_len
    finished: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True                   # transformers' early-stop heuristic
    done: bool = False


@dataclass
class Candidate:
    score: float
    parent: object               # the Sequence it extends
    token: int
    ends: bool = False


def step_beams(state: BeamState, beams: list, tops: dict[int, list[tuple[int, float]]],
               eos_ids: frozenset, fork: Callable, drop: Callable) -> list:
    """One beam step. `beams`: live sequences (each with .token_ids,
    .cumulative_logprob, .seq_id), all computed up to their last token;
    `tops[seq_id]`: that beam's best (token, logprob). `fork(parent, token)`
    returns a new sequence; `drop(seq)` frees one. Returns the live beams."""
    p, width = state.params, state.params.beam_width
    cur_len = len(beams[0].token_ids)
    keep = 2 * width
    candidates = sorted((Candidate(b.cumulative_logprob + lp, b, tok)
                         for b in beams for tok, lp in tops[b.seq_id][:keep]),
                        key=lambda c: -c.score)[:keep]
    at_limit = cur_len + 1 >= state.max_len
    for c in candidates:
        c.ends = at_limit or (not p.ignore_eos and c.token in eos_ids)
    _finish_hypotheses(state, candidates[:width], cur_len)
    chosen = [c for c in candidates if not c.ends][:width]
    new_beams = _advance(chosen, beams, fork, drop)
    if len(state.finished) == width:
        best = max((b.cumulative_logprob for b in new_beams), default=float("-inf"))
        length = ((state.max_len - state.prompt_len) if p.early_stopping == "never"
                  and p.length_penalty > 0 else cur_len + 1 - state.prompt_len)
        state.improvable = state.improvable and best / length ** p.length_penalty > min(
            h.score for h in state.finished)
    full_and_eager = len(state.finished) == width and p.early_stopping is True
    state.done = (not state.improvable or full_and_eager
                  or all(c.ends for c in candidates) or not new_beams)
    return new_beams


def _finish_hypotheses(state: BeamState, top: list[Candidate], cur_len: int) -> None:
    p, width = state.params, state.params.beam_width
    if not state.improvable or (len(state.finished) == width and p.early_stopping is True):
        return
    norm = (cur_len + 1 - state.prompt_len) ** p.length_penalty
    for c in top:
        if c.ends:
            tokens = c.parent.token_ids[state.prompt_len:] + [c.token]
            state.finished.append(Hypothesis(tokens, c.score / norm, c.score))
    state.finished.sort(key=lambda h: -h.score)
    del state.finished[width:]


def _advance(chosen: list[Candidate], beams: list, fork: Callable, drop: Callable) -> list:
    """Parents chosen once extend in place, more often fork; the rest are dropped."""
    used: dict[int, int] = {}
    new_beams = []
    extend_in_place: list[Candidate] = []
    for c in chosen:
        if used.get(c.parent.seq_id):
            new_beams.append(fork(c.parent, c.token, c.score))
        else:
            extend_in_place.append(c)
        used[c.parent.seq_id] = used.get(c.parent.seq_id, 0) + 1
    for b in beams:
        if not used.get(b.seq_id):
            drop(b)
    for c in extend_in_place:          # after the forks copied the parents' tokens
        c.parent.token_ids.append(c.token)
        c.parent.cumulative_logprob = c.score
        new_beams.append(c.parent)
    return new_beams
