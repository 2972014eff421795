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
                self.misses += 1
                self._cache[key] = compiled
                if len(self._cache) > self.max_cached:
                    self._cache.popitem(last=False)
        spec.compiled = compiled
        return compiled

    def _compile(self, key: tuple[str, str]) -> Any:
        compiler = self._get_compiler()
        kind, text = key
        try:
            if kind == "json":
                return compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "json_object":       # OpenAI's json_object: an object, any keys
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
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
