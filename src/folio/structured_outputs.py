"""What a request's output must match (vLLM's `StructuredOutputsParams`):
exactly one of a JSON schema, any JSON object, a regex, a choice of strings,
or an EBNF / Lark grammar. Plain data, checked when made; the engine compiles
it to a grammar (engine/grammar.py) and the runner masks every step's logits
to the tokens the grammar allows next.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional, Union

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    json: Union[None, str, dict[str, Any]] = None   # a JSON schema (text or object)
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None                   # EBNF (GBNF style) or Lark
    json_object: Optional[bool] = None              # any JSON object
    # the compiled grammar, set by the engine's validation (never pickled)
    compiled: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, regex, choice, "
                             f"grammar and json_object; got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured outputs json must be a JSON schema, as an object or "
                             "its text")
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured outputs json is not valid JSON: {e}") from e
            if not isinstance(parsed, dict):
                raise ValueError("structured outputs json must be a JSON schema object")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs {name} must be a non-empty string")
        if self.choice is not None and (
                not isinstance(self.choice, (list, tuple)) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured outputs choice must be a non-empty list of non-empty "
                             "strings")
        if self.json_object not in (None, True):
            raise ValueError("structured outputs json_object must be true")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints compile once."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            # the properties' order is the output's order: not sorted
            value = json.dumps(json.loads(value) if isinstance(value, str) else value,
                               separators=(",", ":"))
        elif kind == "choice":
            value = json.dumps(list(value))
        elif kind == "json_object":
            value = ""
        return kind, value

    def __getstate__(self):
        # tensor-parallel workers get a copy of the request and never sample
        state = dict(self.__dict__)
        state["compiled"] = None
        return state
