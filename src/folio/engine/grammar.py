"""Structured outputs compiled to grammars with xgrammar, once per distinct
constraint.

`Grammars` holds one xgrammar compiler for the model's tokenizer (made at the
first constrained request: xgrammar and its tokenizer table take seconds to
load) and a cache of compiled grammars by the constraint's canonical text, so
the same schema is compiled once. A constraint xgrammar cannot compile (a
schema with an unknown type, a regex that does not parse, a grammar with a
syntax error) is a ValueError naming it: the request is refused, never run
unconstrained. The compiled grammar rides on the request's
StructuredOutputsParams (`compiled`) to the runner, which keeps a matcher per
sequence (worker/grammar_state.py).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from typing import Any

from folio.structured_outputs import StructuredOutputsParams
from folio.tokenizer import Tokenizer

logger = logging.getLogger("folio")


class Grammars:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_cached: int = 256, threads: int = 2):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.max_cached, self.threads = max_cached, threads
        self._compiler = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()       # the server compiles in worker threads
        self.hits = self.misses = 0

    def _get_compiler(self):
        if self._compiler is None:
            try:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast
            except ImportError as e:      # pragma: no cover - depends on the install
                raise ValueError("structured outputs need xgrammar: pip install "
                                 "xgrammar==0.2.8") from e
            t0 = time.perf_counter()
            hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer._backend)
            info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads)
            logger.info("structured outputs: xgrammar ready in %.1f s",
                        time.perf_counter() - t0)
        return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of `spec` (cached), also set on spec.compiled."""
        key = spec.key()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.hits += 1
            else:
                compiled = self._compile(key)
                _check_has_output(compiled, key[0], self.vocab_size)
                self.misses += 1
                self._cache[key] = compiled
                if len(self._cache) > self.max_cached:
                    self._cache.popitem(last=False)
        spec.compiled = compiled
        return compiled

    def _compile(self, key: tuple[str, str]) -> Any:
        compiler = self._get_compiler()
        kind, text = key
        if kind == "json":
            bad = unenforced_keywords(json.loads(text))
            if bad:
                raise ValueError(f"structured outputs json uses what Folio cannot enforce: "
                                 f"{', '.join(bad)} (not supported: {', '.join(UNENFORCED)}, "
                                 f"uniqueItems, allOf of several schemas)")
        try:
            if kind == "json" and json.loads(text) in ({}, {"type": "object"}) or \
                    kind == "json_object":
                # any JSON (value or object, OpenAI's json_object): numbers bounded
                root = "value" if kind == "json" and text == "{}" else "object"
                return compiler.compile_grammar(ANY_JSON.replace("root ::= value",
                                                                 f"root ::= {root}"))
            if kind == "json":
                return compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                return compiler.compile_regex("|".join(_regex_literal(c)
                                                       for c in json.loads(text)))
            if text.lstrip().startswith(("start:", "?start:")) or "\nstart:" in text:
                return compiler.compile_lark(text)
            return compiler.compile_grammar(text)
        except RuntimeError as e:     # xgrammar's parse and conversion errors
            raise ValueError(f"structured outputs {kind} cannot be compiled: "
                             f"{_reason(e)}") from e


def _check_has_output(compiled: Any, kind: str, vocab_size: int) -> None:
    """A grammar that allows no first token has no output at all (a schema
    that only refers to itself, {"$ref": "#"}): refused when compiled, rather
    than a request that could not take one token."""
    import xgrammar as xgr
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    if not bool(bitmask.any()):
        raise ValueError(f"structured outputs {kind} accepts no output at all (a schema "
                         f"that only refers to itself, or contradicts itself)")


# Any JSON, as xgrammar's compact JSON-schema grammars write it (", " and ": "
# between items, no other whitespace), but with numbers of at most 16 digits
# before the point, 16 after and 3 in the exponent: a small model asked for
# "any JSON" may otherwise write the digits of one number until max_tokens
# (issue 34: 8,181 tokens of one number). Strings, members and nesting stay
# unbounded: --max-tokens-limit and --request-timeout bound those.
ANY_JSON = r"""
root ::= value
value ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" "}" | "{" member (", " member)* "}"
member ::= string ": " value
array ::= "[" "]" | "[" value (", " value)* "]"
string ::= "\"" char* "\""
char ::= [^"\\\0-\x1f] | "\\" escape
escape ::= ["\\/bfnrt] | "u" [A-Fa-f0-9]{4}
number ::= "-"? integer fraction? exponent?
integer ::= "0" | [1-9] [0-9]{0,15}
fraction ::= "." [0-9]{1,16}
exponent ::= [eE] [+\-]? [0-9]{1,3}
"""

# JSON-schema keywords xgrammar 0.2.8 accepts but does not enforce (each probed:
# it let a violating text through), so a schema using them is refused rather
# than answered as if it held; tests/engine/test_structured_outputs.py probes
# them again, so a newer xgrammar that enforces one shows up there.
UNENFORCED = ("if", "then", "else", "not", "dependentRequired")
# subschemas: where a schema holds other schemas (property names are not keywords)
_ONE = ("additionalProperties", "items", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "not", "if", "then", "else")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def unenforced_keywords(schema: Any, where: str = "#") -> list[str]:
    """Where `schema` uses what the grammar would not hold to: the keywords
    above, `uniqueItems: true`, and `allOf` of more than one schema."""
    if not isinstance(schema, dict):
        return []
    found = [f"{where}/{k}" for k in UNENFORCED if k in schema]
    if schema.get("uniqueItems") is True:
        found.append(f"{where}/uniqueItems")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        found.append(f"{where}/allOf")
    for k in _ONE:
        found += unenforced_keywords(schema.get(k), f"{where}/{k}")
    for k in _MANY:
        for i, sub in enumerate(schema.get(k) or [] if isinstance(schema.get(k), list) else []):
            found += unenforced_keywords(sub, f"{where}/{k}/{i}")
    for k in _NAMED:
        subs = schema.get(k)
        if isinstance(subs, dict):
            for name, sub in subs.items():
                found += unenforced_keywords(sub, f"{where}/{k}/{name}")
    return found


def _regex_literal(text: str) -> str:
    special = set(r".^$*+?()[]{}|\/")
    return "".join("\\" + c if c in special else c for c in text)


def _reason(e: Exception) -> str:
    """xgrammar's message without its source location prefix."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "] " in text and text.startswith("["):
        text = text.split("] ", 1)[1]
    if ": " in text and ".cc:" in text.split(": ", 1)[0]:
        text = text.split(": ", 1)[1]
    return text
