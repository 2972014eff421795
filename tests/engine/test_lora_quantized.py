"""LoRA adapters over packed bases (issue 31): a GPTQ and an AWQ checkpoint
made by their real tools (tests/fixtures/quant), run in their codes with a
peft adapter beside them, give transformers + peft's greedy tokens on the
checkpoint's float copy (the format's own dequantization formula) with the
adapter merged, alone and beside base requests."""

import pytest

from folio import LLM, LoRARequest, SamplingParams
from tests.model.quantization.checkpoints import FIXTURES, float_model, write_float_copy
from tests.model.quantization.test_awq import awq_formula
from tests.model.quantization.test_gptq import gptq_formula
from tests.parity import assert_greedy_parity, reference_greedy
from tests.utils import make_lora_adapter

NEW = 12


@pytest.mark.parametrize("name, formula", [("gptq-w4-g32-sym", lambda: gptq_formula(4)),
                                           ("awq-w4-g32", awq_formula)])
def test_an_adapter_over_packed_codes_is_peft_on_the_float_copy(tmp_path, name, formula):
    floats = write_float_copy(name, formula(), tmp_path / "float")
    path, merged = make_lora_adapter(floats, tmp_path / "adapter", seed=3, r=8, lora_alpha=16,
                                     target_modules=["q_proj", "v_proj", "o_proj", "up_proj",
                                                     "down_proj"])
    llm = LLM(str(FIXTURES / name), dtype="float32", num_kv_blocks=64, enable_lora=True,
              activation_quantization="none")
    prompts = [list(range(3, 30)), list(range(90, 60, -1))]
    lora = LoRARequest("a", 1, path)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2],
                        SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
                        lora_request=[lora, lora, None, None], use_tqdm=False)
    base = float_model(floats)
    for i, out in enumerate(outs):
        ref = merged if i < 2 else base
        want, gaps = reference_greedy(ref, prompts[i % 2], NEW, ())
        assert_greedy_parity(out.outputs[0].token_ids, want, gaps, label=f"{name} {i}")
    assert outs[0].outputs[0].token_ids != outs[2].outputs[0].token_ids
    assert llm.engine.scheduler.kv.num_free_blocks == 64
