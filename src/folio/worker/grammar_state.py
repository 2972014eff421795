"""A constrained sequence's place in its grammar, and the logits mask.

Each sequence with structured outputs keeps an xgrammar matcher. The matcher
follows the sequence's own tokens: before each sample it is fed the outputs
it has not seen yet (the token sampled last step, or, for a sequence
recomputed after preemption or a forked sample, every output so far), read
from the runner's record of the sequence's tokens. So preemption, prefix-cache
hits and n > 1 need nothing else. The mask sets the logits of every token the
grammar does not allow next to -inf, on the constrained rows only; the other
rows of the batch are not touched.

A grammar that leaves a sequence no token it may take (its language ends
while min_tokens still bans the end, or it had no string at all) is the
request's own doing: ConstraintDeadEnd, which fails that request alone with
a 400 before a token is sampled from a row that allows none.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


class ConstraintDeadEnd(ValueError):
    """A constrained sequence's grammar allows no token it may take next."""


def _int32_bit(t: int) -> int:
    bit = 1 << (t % 32)
    return bit - (1 << 32) if bit >= 1 << 31 else bit


class GrammarState:
    def __init__(self, compiled: Any, start: int = 0):
        import xgrammar as xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.start = start      # where the outputs begin in the sequence's tokens
        self.fed = 0            # outputs the matcher has accepted

    def catch_up(self, tokens: list[int]) -> None:
        """Feed the outputs among `tokens` (the sequence's, prompt first) not fed yet."""
        seen = self.start + self.fed
        for token in tokens[seen:]:
            if self.matcher.is_terminated():
                break           # EOS accepted: the rest (ignore_eos) is past the grammar
            if not self.matcher.accept_token(token):
                raise ConstraintDeadEnd(f"token {token} does not follow the grammar")
        self.fed = len(tokens) - self.start


def apply_grammars(logits: torch.Tensor, states: list[Optional[GrammarState]],
                   tokens: list[Optional[list[int]]],
                   proposals: Optional[dict[int, list[int]]] = None,
                   may_not_end: Optional[dict[int, tuple[int, ...]]] = None) -> None:
    """Mask `logits` [S, V] in place: row i to what states[i] allows after the
    sequence's tokens[i] (rows whose state is None are left as they are).

    A sequence with proposed tokens d1..dk (speculative decoding, `proposals`
    by the row of its first of k + 1 consecutive rows) has its row j masked
    to what the grammar allows after d1..dj: the matcher takes the proposals
    as far as the grammar lets it, fills each row, and is rolled back. Rows
    past a proposal the grammar refuses keep the last mask: the proposal is
    then one the masked row cannot pick, so verification ends there.

    `may_not_end`: rows whose sequence may not end yet (min_tokens), with the
    tokens banned until then; a row that the grammar leaves nothing else, or
    nothing at all, raises ConstraintDeadEnd."""
    import xgrammar as xgr
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return
    bitmask = xgr.allocate_token_bitmask(len(states), logits.shape[-1])
    follow: dict[int, int] = {}      # row -> the proposal row it repeats
    for i in rows:
        if i in follow:
            continue
        state = states[i]
        state.catch_up(tokens[i])
        _fill(state, bitmask, i)
        _check_open(state, bitmask[i], (may_not_end or {}).get(i))
        drafts = (proposals or {}).get(i, ())
        taken = 0
        for j, token in enumerate(drafts, start=1):
            if not state.matcher.is_terminated() and state.matcher.accept_token(token):
                taken += 1
                _fill(state, bitmask, i + j)
            else:
                for rest in range(i + j, i + len(drafts) + 1):
                    bitmask[rest] = bitmask[i + j - 1]
                break
        for j in range(1, len(drafts) + 1):
            follow[i + j] = i
        if taken:
            state.matcher.rollback(taken)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)


def _check_open(state: GrammarState, row: torch.Tensor,
                banned: Optional[tuple[int, ...]]) -> None:
    """ConstraintDeadEnd where the filled `row` allows no token but `banned`."""
    if banned and not state.matcher.is_terminated():
        row = row.clone()
        for t in banned:
            row[t // 32] &= ~_int32_bit(t)
        if not bool(row.any()):
            raise ConstraintDeadEnd(
                f"after {state.fed} tokens the structured output allows only its end, but "
                f"min_tokens bans ending yet: no token can follow")
    elif not bool(row.any()):
        raise ConstraintDeadEnd(f"after {state.fed} tokens the structured output allows no "
                                f"token at all")


def _fill(state: GrammarState, bitmask: torch.Tensor, row: int) -> None:
    """What the matcher allows next into bitmask[row]: once it has taken EOS,
    only the stop tokens (ignore_eos runs past the grammar)."""
    if state.matcher.is_terminated():
        bitmask[row].zero_()
        for t in state.matcher.stop_token_ids:
            bitmask[row, t // 32] |= _int32_bit(t)
    else:
        state.matcher.fill_next_token_bitmask(bitmask, row)
