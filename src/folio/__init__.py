"""Folio: a self-hosted LLM inference and serving engine."""

from folio.core.beam import BeamSearchParams
from folio.lora_request import LoRARequest
from folio.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
from folio.pooling_params import PoolingParams
from folio.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "SamplingParams", "BeamSearchParams", "PoolingParams",
           "RequestOutput", "CompletionOutput", "EmbeddingRequestOutput", "LoRARequest"]


def __getattr__(name):
    # Lazy: importing folio for SamplingParams must not pull in torch.
    if name == "LLM":
        from folio.engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from folio.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
