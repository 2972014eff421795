"""A LoRA adapter of the default model (tests/fixtures/lora/smollm2-qv, made
by peft on the default model's float weights: scripts/make_lora_fixtures.py):
Folio on the GGUF's codes with the adapter gives transformers + peft's greedy
tokens and prompt logprobs on the same weights (fp32), alone and in a batch
beside the base model; and the adapter does change the answers."""

import copy
from pathlib import Path

import pytest
import torch

from folio import LLM, LoRARequest, SamplingParams
from tests.parity import assert_greedy_parity, reference_greedy, reference_prompt_logprobs

ADAPTER = str(Path(__file__).resolve().parent.parent / "fixtures" / "lora" / "smollm2-qv")
NEW = 16


@pytest.fixture(scope="module")
def merged(default_reference):
    """transformers + peft: the adapter loaded by peft onto a copy of the
    default reference model (the shared one stays as it is), merged."""
    from peft import PeftModel
    return PeftModel.from_pretrained(copy.deepcopy(default_reference), ADAPTER).merge_and_unload()


def test_the_default_model_with_a_peft_adapter_is_transformers_and_peft(
        default_reference, merged):
    llm = LLM(dtype="float32", num_kv_blocks=256, max_model_len=2048,
              activation_quantization="none", enable_lora=True, max_lora_rank=8)
    tok = llm.get_tokenizer()
    prompts = [tok.encode_chat([{"role": "user", "content": q}])
               for q in ("What is the capital of France?", "Name a primary color.")]
    lora = LoRARequest("qv", 1, ADAPTER)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2],
                        SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
                        lora_request=[lora, lora, None, None], use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    for i, (ref, p) in enumerate([(merged, prompts[0]), (merged, prompts[1]),
                                  (default_reference, prompts[0]),
                                  (default_reference, prompts[1])]):
        want, gaps = reference_greedy(ref, p, NEW, ())
        assert_greedy_parity(got[i], want, gaps, label=f"request {i}")
    assert got[0] != got[2] and got[1] != got[3]      # the adapter changes the answers
    out = llm.generate({"prompt_token_ids": prompts[0]},
                       SamplingParams(max_tokens=1, prompt_logprobs=0), lora_request=lora,
                       use_tqdm=False)[0]
    logprobs = torch.tensor([e[t] for e, t in zip(out.prompt_logprobs[1:], prompts[0][1:])])
    assert torch.allclose(logprobs, reference_prompt_logprobs(merged, prompts[0]), atol=1e-4)
    assert llm.engine.scheduler.kv.num_free_blocks == 256
