"""Prompts and chats -> token ids -> a validated Request.

Every check runs here, before the request reaches the scheduler, so a bad
input raises a ValueError a user understands and takes no block. Each request
is checked once: a caller that validated already (the async engine, for the
server) says so to `make_request`, which then only builds.
"""

from __future__ import annotations

import random
from typing import Any, Optional, Union

from folio.config import FolioConfig
from folio.core.beam import BeamSearchParams
from folio.engine.grammar import Grammars
from folio.pooling_params import PoolingParams, model_pooling
from folio.request import Request, Sequence, next_seq_id
from folio.sampling_params import SamplingParams
from folio.tokenizer import Tokenizer

PromptType = Union[str, dict[str, Any]]


class InputProcessor:
    def __init__(self, config: FolioConfig, tokenizer: Tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = config.model.vocab_size
        self.eos_token_ids = tuple(tokenizer.eos_token_ids) or config.model.eos_token_ids
        self._rng = random.Random(config.seed)   # seeds for requests that give none
        self.grammars = Grammars(tokenizer, self.vocab_size, self.eos_token_ids)
        self.model_pooling: Optional[PoolingParams] = None    # read on first use

    def tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """(prompt text or None, prompt token ids). Token ids are used verbatim."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: give at least one token")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(
                        isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError(
            "a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}, "
            f"got {type(prompt).__name__}")

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.config.max_logprobs:
                raise ValueError(f"{name}={asked} is more than max_logprobs "
                                 f"({self.config.max_logprobs})")
        if params.logit_bias:
            outside = [t for t in params.logit_bias if not 0 <= t < self.vocab_size]
            if outside:
                raise ValueError(f"logit_bias token id {outside[0]} is outside the vocabulary "
                                 f"(0..{self.vocab_size - 1})")
        outside = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if outside:
            raise ValueError(f"stop_token_ids: {outside[0]} is outside the vocabulary "
                             f"(0..{self.vocab_size - 1})")
        if self.config.model.encoder or self.config.model.headless:
            what = (f"an encoder ({self.config.model.architecture})" if self.config.model.encoder
                    else "a base model without an LM head")
            raise ValueError(f"{self.config.model.model} is {what}: it computes embeddings "
                             "(LLM.embed, /v1/embeddings), it does not generate")
        self._check_ids(prompt_ids, "prompt")
        limit = self.config.max_model_len
        if len(prompt_ids) >= limit:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens but max_model_len is {limit}: "
                f"it must leave room for at least one generated token")
        if params.structured_outputs is not None:     # last: the one check that costs
            self.grammars.compile(params.structured_outputs)

    def validate_beam(self, prompt_ids: list[int], params: BeamSearchParams) -> None:
        """A beam search's checks: its width against max_logprobs, then those of
        the greedy sampling it runs."""
        if 2 * params.beam_width > self.config.max_logprobs:
            raise ValueError(f"beam_width {params.beam_width} ranks the top {2 * params.beam_width}"
                             f" tokens of every beam, more than max_logprobs "
                             f"({self.config.max_logprobs}; --max-logprobs raises it)")
        self.validate(prompt_ids, self.beam_sampling(params))

    def _check_ids(self, prompt_ids: list[int], what: str) -> None:
        """Not empty, and every id in the vocabulary."""
        if not prompt_ids:
            raise ValueError(f"the {what} is empty: give at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")

    def resolve_pooling(self, prompt_ids: list[int], params: PoolingParams) -> PoolingParams:
        """An embedding request's checks (its prompt may fill max_model_len:
        nothing is generated after it) and its params with the model's
        pooling where unset."""
        self._check_ids(prompt_ids, "input")
        limit = self.config.max_model_len
        if len(prompt_ids) > limit:
            raise ValueError(f"the input has {len(prompt_ids)} tokens, more than max_model_len "
                             f"({limit})")
        model = self.config.model
        if self.model_pooling is None:
            self.model_pooling = (PoolingParams(pooling="classify") if model.num_labels
                                  else model_pooling(model.path))
        params = params.resolved(self.model_pooling, model.hidden_size)
        if (params.pooling == "classify") != bool(model.num_labels):
            raise ValueError(f"pooling {params.pooling!r}: {model.model} is "
                             + ("a cross-encoder: it gives scores (pooling classify)"
                                if model.num_labels else "not a cross-encoder: it has no "
                                "classifier to score with"))
        if params.pooling == "classify" and params.dimensions is not None:
            raise ValueError("dimensions applies to embeddings, not to a classifier's logits")
        if params.second_text_start is not None and params.second_text_start > len(prompt_ids):
            raise ValueError(f"second_text_start={params.second_text_start} is past the input's "
                             f"{len(prompt_ids)} tokens")
        return params

    # what an embedding request runs as: its prompt, then one greedy step that
    # is never sampled (the runner pools the prompt instead)
    POOLING_SAMPLING = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def check(self, prompt_ids: list[int], params):
        """A request's checks, whatever its kind (sampling, beam search,
        embedding); its params as the engine runs them (an embedding's
        resolved against the model's pooling)."""
        if isinstance(params, BeamSearchParams):
            self.validate_beam(prompt_ids, params)
        elif isinstance(params, PoolingParams):
            return self.resolve_pooling(prompt_ids, params)
        else:
            self.validate(prompt_ids, params)
        return params

    def make_pooling_request(self, request_id: str, prompt_ids: list[int],
                             params: PoolingParams, arrival_time: Optional[float] = None,
                             priority: int = 0) -> Request:
        """An embedding request of resolved `params`: its prompt, pooled."""
        request = self.make_request(request_id, prompt_ids, self.POOLING_SAMPLING,
                                    arrival_time, priority, validated=True)
        request.pooling = params
        return request

    @staticmethod
    def beam_sampling(params: BeamSearchParams) -> SamplingParams:
        """Greedy steps that report each beam's top 2W logprobs."""
        return SamplingParams(temperature=0, max_tokens=params.max_tokens,
                              logprobs=2 * params.beam_width, ignore_eos=params.ignore_eos)

    def make_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     arrival_time: Optional[float] = None, priority: int = 0,
                     validated: bool = False) -> Request:
        """`validated`: the caller ran `validate` on these very ids and params."""
        if not validated:
            self.validate(prompt_ids, params)
        seqs = []
        for i in range(params.n):
            # The i-th sample of a seeded request is reproducible on its own.
            seed = params.seed + i if params.seed is not None else self._rng.getrandbits(63)
            seqs.append(Sequence(next_seq_id(), i, prompt_ids, seed))
        return Request(request_id, prompt_ids, params, seqs, self.eos_token_ids,
                       arrival_time=arrival_time, priority=priority)
