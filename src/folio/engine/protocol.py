"""EngineClient: everything a front end (the HTTP server) may ask of the engine.

The server holds an EngineClient and nothing else of the engine: not the
LLMEngine, its scheduler, the model or the workers. That keeps the boundary
one list of calls, so the engine core could move to its own process without
the server changing. It is a typing.Protocol, so a test may stand in any
object with these members; AsyncLLMEngine implements it (and names it as a
base, so a type checker holds it to these signatures).

A request is validated once, in the input processor: `validate` returns the
prompt as a ValidatedPrompt, and `generate` given that prompt with the same
params does not check it again. A front end validates every request before it
starts a response, so a bad one is a 400 before any byte of a stream.
"""

from __future__ import annotations

from typing import (TYPE_CHECKING, AsyncIterator, Callable, Optional, Protocol, Union,
                    runtime_checkable)

from folio.config import ModelConfig
from folio.core.beam import BeamSearchParams
from folio.engine.stats import StepStats
from folio.lora_request import LoRARequest
from folio.outputs import RequestOutput
from folio.pooling_params import PoolingParams
from folio.sampling_params import SamplingParams

if TYPE_CHECKING:
    from folio.tokenizer import Tokenizer

__all__ = ["BeamSearchParams", "EngineClient", "EngineDeadError", "Params",
           "RequestFailedError", "StepCallback", "StepStats", "ValidatedPrompt",
           "default_model"]

# PoolingParams: an embedding request (its RequestOutput an EmbeddingRequestOutput)
Params = Union[SamplingParams, BeamSearchParams, PoolingParams]
# Called in the engine thread after every step: the scheduler's numbers, then the
# outputs of that step (aborted requests included).
StepCallback = Callable[[StepStats, list[RequestOutput]], None]


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an internal error; the server must report 503."""


class RequestFailedError(RuntimeError):
    """One request failed inside an engine step (its inputs could not be prepared
    or sampled); it was aborted and its blocks freed, and the engine goes on
    serving the others. Not the client's fault as far as validation could tell,
    so the server answers 500 for that request alone."""


class RequestRefusedError(ValueError):
    """One request the engine ended because of what it asked for (its
    structured output left no token it could take: a ConstraintDeadEnd):
    aborted, its blocks freed, and a 400 for that request alone."""


# the faults (describe_fault's "Name: message") that are the request's own doing
REFUSED_FAULTS = ("ConstraintDeadEnd",)


def engine_error(error: str) -> Exception:
    """The exception a request's engine error (RequestOutput.error) is raised as."""
    name, _, message = error.partition(": ")
    if name in REFUSED_FAULTS:
        return RequestRefusedError(f"the request cannot go on: {message}")
    return RequestFailedError(f"the request failed in the engine: {error}")


class ValidatedPrompt(list):
    """Prompt token ids that passed the input processor's checks with `params`.

    A list, so it goes wherever prompt ids go. It vouches only for the params
    object it was checked with (compared by identity): neither may change after.
    """

    __slots__ = ("params",)

    def __init__(self, prompt_ids: list[int], params: Params):
        super().__init__(prompt_ids)
        self.params = params

    def validates(self, params: Params) -> bool:
        return self.params is params


@runtime_checkable
class EngineClient(Protocol):
    def generate(self, request_id: str, prompt: Optional[str], prompt_ids: list[int],
                 params: Params, priority: int = 0,
                 lora_request: Optional[LoRARequest] = None) -> AsyncIterator[RequestOutput]:
        """Cumulative RequestOutputs until the finished one (under the LoRA
        adapter `lora_request`, if given); leaving the iteration
        early aborts the request. Raises ValueError for a bad request (checked
        here unless `prompt_ids` is `validate`'s answer for these params),
        EngineDeadError once the engine has stopped, RequestFailedError when the
        engine failed this request alone."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed. An unknown id is ignored."""
        ...

    def check_lora(self, lora_request: LoRARequest) -> None:
        """A LoRA adapter loaded and checked against the model; ValueError naming
        what does not fit, or that LoRA is not enabled."""
        ...

    def validate(self, prompt_ids: list[int], params: Params) -> ValidatedPrompt:
        """The input processor's checks (token ids, lengths, logprobs, beam width);
        ValueError with the message a client sees, as a 400. For PoolingParams
        the answer's `params` are them resolved against the model's pooling:
        what `generate` is then given."""
        ...

    @property
    def tokenizer(self) -> "Tokenizer":
        ...

    @property
    def model_config(self) -> ModelConfig:
        """What the checkpoint is: path, vocab_size, hyperparameters."""
        ...

    @property
    def max_model_len(self) -> int:
        """Prompt plus completion tokens one sequence may hold."""
        ...

    @property
    def scheduling_policy(self) -> str:
        """"fcfs" or "priority": whether a request's priority is read at all."""
        ...

    @property
    def is_dead(self) -> bool:
        ...

    def check_health(self) -> None:
        """EngineDeadError if the engine loop has stopped."""
        ...

    @property
    def num_in_flight(self) -> int:
        """Requests the engine holds now (running, waiting, or being streamed
        back): a router's measure of this server's load."""
        ...

    async def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache between steps; False (nothing done) while
        requests hold blocks."""
        ...

    def check_kv_cache(self) -> None:
        """ValueError (saying what to give) if the KV cache cannot hold one
        sequence of max_model_len tokens: such a server would refuse its longest
        requests forever, so it must not start."""
        ...

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; every waiting request is told; workers exit too."""
        ...


def default_model() -> str:
    """The model `folio serve` loads when given none, without importing the
    loader (and torch) at import time."""
    from folio.model.loader import DEFAULT_MODEL
    return DEFAULT_MODEL
