"""Hugging Face `transformers` baselines on the same weights and dtype.

hf-seq:    `generate`, one request at a time (what teams run before a serving engine).
hf-static: fixed left-padded batches, each running until its longest member is
           done; only each request's own output tokens are counted.
Both decode greedily and ignore EOS, exactly `max_tokens` tokens per request.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from folio.bench.datasets import BenchRequest
from folio.config import ModelConfig


def load_hf_model(m: ModelConfig, dtype: torch.dtype):
    """transformers' model on the same weights, dense in `dtype`.

    For GGUF files transformers would keep the weights packed and compute in
    fp32 whatever dtype is asked; to compare like with like, its model is
    built from the GGUF's config and given our dequantized tensors (the loader
    tests prove them equal to transformers' own dequantization)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:    # pragma: no cover - depends on the install
        raise ValueError("the transformers baselines need transformers: pip install -e "
                         "'.[bench]' in the Folio checkout") from e
    if m.format == "gguf":
        from folio.model.loader import iter_weights
        # every tensor dequantized (Folio keeps Q4_0/Q4_1/Q8_0 in their codes)
        dense = dataclasses.replace(m, quantization=None, quantization_config=None)
        config = AutoConfig.from_pretrained(os.path.dirname(m.path),
                                            gguf_file=os.path.basename(m.path))
        config.tie_word_embeddings = m.tie_word_embeddings
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        missing, unexpected = model.load_state_dict(dict(iter_weights(dense)), strict=False)
        if unexpected or [k for k in missing if "lm_head" not in k]:
            raise ValueError(f"weights do not fit the reference model: {missing or unexpected}")
        model.tie_weights()
    else:
        model = AutoModelForCausalLM.from_pretrained(m.path, dtype=dtype)
    model.generation_config.eos_token_id = None     # ignore EOS: run to max_tokens
    return model.eval()


@torch.inference_mode()
def _generate(model, input_ids, attention_mask, new_tokens: int):
    # on the model's device: ids left on the CPU beside a CUDA model cost each step a copy
    input_ids, attention_mask = input_ids.to(model.device), attention_mask.to(model.device)
    return model.generate(input_ids, attention_mask=attention_mask, do_sample=False,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          eos_token_id=None, pad_token_id=0)


def run_hf_seq(model, requests: list[BenchRequest], progress=None) -> tuple[int, float]:
    """(output tokens, seconds)."""
    tokens, t0 = 0, time.perf_counter()
    for r in requests:
        ids = torch.tensor([r.prompt_token_ids])
        out = _generate(model, ids, torch.ones_like(ids), r.max_tokens)
        tokens += out.shape[1] - ids.shape[1]
        if progress:
            progress(1)
    return tokens, time.perf_counter() - t0


def run_hf_static(model, requests: list[BenchRequest], batch_size: int,
                  progress=None) -> tuple[int, float]:
    """(the requests' own output tokens, seconds) with fixed left-padded batches."""
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for j, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            ids[j, width - n:] = torch.tensor(r.prompt_token_ids)
            mask[j, width - n:] = 1
        _generate(model, ids, mask, max(r.max_tokens for r in batch))
        tokens += sum(r.max_tokens for r in batch)
        if progress:
            progress(len(batch))
    return tokens, time.perf_counter() - t0
