"""Speculative decoding's control side: the configuration a user gives
(`--speculative-config` JSON, `LLM(speculative_config=...)`) and the n-gram
proposer. Pure Python, like the rest of core/.

A sequence in decode may carry proposed tokens: the scheduler sends its last
token followed by the proposals as one query span, the runner verifies them
against the target model's own choices on those rows and returns the
accepted ones followed by one token of its own (worker/spec_verify.py),
and the scheduler keeps what was accepted (Scheduler.update_from_output).
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any, Optional, Union

from folio.config import SpeculativeConfig

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16


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
    if method == "draft_model":
        raise ValueError("speculative_config: method 'draft_model' is not supported yet; "
                         "use 'ngram'")
    if method not in METHODS:
        raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, "
                         f"got {method!r}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(known))}")
    args: dict[str, Any] = dict(value)
    # vLLM: one of the two lookup bounds given sets the other
    if "prompt_lookup_max" in args and "prompt_lookup_min" not in args:
        args["prompt_lookup_min"] = min(args["prompt_lookup_max"],
                                        SpeculativeConfig.prompt_lookup_min)
    if "prompt_lookup_min" in args and "prompt_lookup_max" not in args:
        args["prompt_lookup_max"] = max(args["prompt_lookup_min"],
                                        SpeculativeConfig.prompt_lookup_max)
    config = SpeculativeConfig(**args)
    for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
        v = getattr(config, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"speculative_config: {name} must be a positive integer, "
                             f"got {v!r}")
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


def ngram_propose(token_ids: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens: for n from n_max down to n_min, the last n tokens are
    looked for earlier in `token_ids` and the tokens that followed them there
    are proposed: from the latest earlier occurrence that k tokens follow,
    else from the latest (in a loop, the latest occurrence runs into the end
    of the sequence after a few tokens). [] when no suffix recurs."""
    length = len(token_ids)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = token_ids[length - n:]
        last = suffix[-1]
        latest = None
        # a match ends at position e (exclusive) < length: tokens e .. follow it
        for end in range(length - 1, n - 1, -1):
            if token_ids[end - 1] == last and token_ids[end - n:end] == suffix:
                if end + k <= length:
                    return token_ids[end:end + k]
                if latest is None:
                    latest = end
        if latest is not None:
            return token_ids[latest:latest + k]
    return []
