"""Speculative decoding's control side: the configuration a user gives
(`--speculative-config` JSON, `LLM(speculative_config=...)`) and the n-gram
proposer. Pure Python, like the rest of core/.

A sequence in decode may carry proposed tokens: the scheduler sends its last
token followed by the proposals as one query span, the runner verifies them
against the target model's own choices on those rows and returns the
accepted ones followed by one token of its own (worker/spec_verify.py),
and the scheduler keeps what was accepted (Scheduler.update_from_output).
The n-gram proposer runs here; a draft model runs in the runner
(worker/draft_proposer.py), which writes its proposals over the
placeholders the scheduler leaves, as many as the scheduler gave slots.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import fields
from typing import Any, NamedTuple, Optional, Union

from folio.config import SpeculativeConfig

METHODS = ("ngram", "draft_model")
# keys that mean nothing to a method
_NOT_FOR = {"ngram": {"model", "quantization"},
            "draft_model": {"prompt_lookup_max", "prompt_lookup_min"}}
# A draft model's proposals stop while more than this many requests run,
# unless disable_by_batch_size says otherwise: its k steps and the target's
# k + 1 rows per sequence cost more than they save once the target's step is
# bound by arithmetic, not by reading the weights (measured on the default
# model, its float weights drafted for by its own 4-bit codes, 2 cores:
# 1.07x at 16 requests at once, 0.70x at 32; docs/benchmarks.md)
DRAFT_DISABLE_BY_BATCH_SIZE = 16
# what the scheduler puts where a draft model's proposals go: the runner
# writes the draft's tokens over them before the step runs
DRAFT_PLACEHOLDER = 0
MAX_SPECULATIVE_TOKENS = 16


class SpecDecodeCounts(NamedTuple):
    """Totals of verified proposal runs, tokens proposed and tokens accepted:
    the scheduler's, a server's /metrics, or the difference of two readings."""
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def since(self, before: "SpecDecodeCounts") -> "SpecDecodeCounts":
        return SpecDecodeCounts(*(a - b for a, b in zip(self, before)))

    @property
    def acceptance_rate(self) -> Optional[float]:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_accepted_length(self) -> Optional[float]:
        """Tokens a step with proposals yields per sequence."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else None

    def summary(self) -> dict:
        return {"num_drafts": self.drafts, "num_draft_tokens": self.draft_tokens,
                "num_accepted_tokens": self.accepted_tokens,
                "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length}


def parse_speculative_config(value: Union[None, str, dict, SpeculativeConfig]
                             ) -> Optional[SpeculativeConfig]:
    """A SpeculativeConfig from a JSON text or dict with vLLM's keys, checked;
    None for None or {}."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    if not value:
        return None
    method = value.get("method", "ngram")
    if method not in METHODS:
        raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, "
                         f"got {method!r}")
    known = {f.name for f in fields(SpeculativeConfig)} - {"draft"} - _NOT_FOR[method]
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} for "
                         f"method {method}; known: {', '.join(sorted(known))}")
    if method == "draft_model" and (not isinstance(value.get("model"), str)
                                    or not value["model"]):
        raise ValueError("speculative_config: method draft_model needs \"model\", the "
                         "draft's checkpoint (a folder or a .gguf file)")
    q = value.get("quantization")
    if q is not None and not isinstance(q, str):
        raise ValueError(f"speculative_config: quantization must be a name, got {q!r}")
    args: dict[str, Any] = dict(value)
    for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
        v = args.get(name, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"speculative_config: {name} must be a positive integer, "
                             f"got {v!r}")
    # as vLLM: one lookup bound given, the other is the same
    if "prompt_lookup_max" in args and "prompt_lookup_min" not in args:
        args["prompt_lookup_min"] = args["prompt_lookup_max"]
    if "prompt_lookup_min" in args and "prompt_lookup_max" not in args:
        args["prompt_lookup_max"] = args["prompt_lookup_min"]
    if method == "draft_model":
        args.setdefault("disable_by_batch_size", DRAFT_DISABLE_BY_BATCH_SIZE)
    config = SpeculativeConfig(**args)
    if config.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"speculative_config: num_speculative_tokens must be at most "
                         f"{MAX_SPECULATIVE_TOKENS}, got {config.num_speculative_tokens}")
    if config.prompt_lookup_min > config.prompt_lookup_max:
        raise ValueError(f"speculative_config: prompt_lookup_min "
                         f"({config.prompt_lookup_min}) is above prompt_lookup_max "
                         f"({config.prompt_lookup_max})")
    d = config.disable_by_batch_size
    if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
        raise ValueError(f"speculative_config: disable_by_batch_size must be a positive "
                         f"integer, got {d!r}")
    return config


def ngram_propose(token_ids, k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens: for n from n_max down to n_min, the last n tokens are
    looked for earlier in `token_ids` and the tokens that followed them there
    are proposed: from the latest earlier occurrence that k tokens follow,
    else from the latest (in a loop, the latest occurrence runs into the end
    of the sequence after a few tokens). [] when no suffix recurs.

    The search is bytes.rfind over the ids as 4-byte integers (C speed; a
    match must start on a 4-byte boundary), not a Python loop: at 32k tokens
    of context a Python scan took 2.5 ms a sequence and step."""
    ids = token_ids if isinstance(token_ids, array) else array("i", token_ids)
    length = len(ids)
    buf = ids.tobytes()
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = buf[(length - n) * 4:]
        # matches that end before the last token (not the suffix itself)
        pos = _aligned_rfind(buf, pattern, (length - 1) * 4)
        if pos < 0:
            continue
        end = pos // 4 + n
        if end + k > length:        # an earlier one that k tokens follow?
            earlier = _aligned_rfind(buf, pattern, (length - k) * 4)
            if earlier >= 0:
                end = earlier // 4 + n
        return ids[end:end + k].tolist()
    return []


def _aligned_rfind(buf: bytes, pattern: bytes, hi: int) -> int:
    """The last occurrence of `pattern` inside buf[:hi] that starts on a
    4-byte boundary, or -1."""
    pos = buf.rfind(pattern, 0, hi) if hi >= len(pattern) else -1
    while pos > 0 and pos % 4:
        pos = buf.rfind(pattern, 0, pos + len(pattern) - 1)
    return pos


class NgramProposer:
    """ngram_propose over each sequence's ids kept as an int32 array, extended
    by the tokens it gained since the last call (not rebuilt every step)."""

    def __init__(self, n_max: int, n_min: int):
        self.n_max, self.n_min = n_max, n_min
        self._ids: dict[int, array] = {}

    def propose(self, seq_id: int, token_ids: list[int], k: int) -> list[int]:
        ids = self._ids.get(seq_id)
        if ids is None or len(ids) > len(token_ids):
            ids = self._ids[seq_id] = array("i", token_ids)
        elif len(ids) < len(token_ids):
            ids.extend(token_ids[len(ids):])
        return ngram_propose(ids, k, self.n_max, self.n_min)

    def forget(self, seq_id: int) -> None:
        self._ids.pop(seq_id, None)
