"""Helpers for the quantized checkpoints of tests/fixtures/quant: their
transformers reference logits, an exact float copy (the format's formula
applied by this test code, not Folio's) and Folio's own logits; the checks
every format's tests make of them; and edited copies for the bad-input tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from folio.kernels import native
from tests.parity import assert_greedy_parity, reference_greedy

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "quant"
# The formats' tests hold each one's codes to its exact float weights: the
# fp32-arithmetic path (--activation-quantization none). Int8 activations are
# tested on the kernel (test_qlinear_kernel.py) and, for their drift, on the
# default model (tests/engine/test_int8_activations.py).
FP32 = {"activation_quantization": "none"}


def reference(name: str) -> list[tuple[list[int], torch.Tensor]]:
    ref = load_file(str(FIXTURES / name / "reference.safetensors"))
    return [(ref[f"prompt.{i}"].tolist(), ref[f"logits.{i}"])
            for i in range(len([k for k in ref if k.startswith("prompt.")]))]


def write_float_copy(name: str, dequantize, out: Path) -> Path:
    """The checkpoint with every quantized layer replaced by the float weight
    `dequantize(tensors, prefix)` gives: a plain HF folder."""
    folder = FIXTURES / name
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    config["dtype"] = "float32"
    tensors = load_file(str(folder / "model.safetensors"))
    plain = {}
    for key, value in tensors.items():
        prefix, _, kind = key.rpartition(".")
        weight = dequantize(tensors, prefix, kind)
        if weight is not None:
            plain[f"{prefix}.weight"] = weight.float().contiguous()
        elif value.is_floating_point() and key.endswith((".weight", ".bias")):
            plain.setdefault(key, value.float().contiguous())
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    save_file(plain, str(out / "model.safetensors"))
    return out


def unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words along `dim`, lowest bits first (written again here, plainly)."""
    per = 32 // bits
    parts = [(words.long() >> (bits * i)) & ((1 << bits) - 1) for i in range(per)]
    stacked = torch.stack(parts, dim=dim + 1)
    shape = list(words.shape)
    shape[dim] *= per
    return stacked.reshape(shape)


def folio_logits(llm, prompt: list[int], monkeypatch=None) -> torch.Tensor:
    """Folio's logits [len(prompt) - 1, vocab] for every prompt position but the
    last (the model's compute_logits, recorded during a prefill)."""
    from folio import SamplingParams
    from folio.model import llama
    seen = []
    original = llama.LlamaForCausalLM.compute_logits

    def record(self, hidden):
        out = original(self, hidden)
        seen.append(out.float().clone())
        return out

    llama.LlamaForCausalLM.compute_logits = record
    try:
        llm.generate([{"prompt_token_ids": prompt}],
                     SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                     use_tqdm=False)
    finally:
        llama.LlamaForCausalLM.compute_logits = original
    full = [t for t in seen if t.shape[0] >= len(prompt) - 1]
    return full[0][:len(prompt) - 1]


def float_model(folder):
    """transformers' fp32 model of a plain HF folder (e.g. a float copy)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def hf_logits(hf, prompt: list[int]) -> torch.Tensor:
    """transformers' logits [len(prompt) - 1, vocab], the positions
    `folio_logits` gives."""
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, :-1]


# --------------------------------------------------------------------------- the checks

# the `kernel` parameter of a test that runs both paths of the quantized layers
kernel_or_torch = pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])


def use_kernel(kernel: bool, monkeypatch) -> None:
    """True: the quantized linear kernel (the test is skipped where the
    machine has none); False: the torch path, the kernel switched off
    (native.runs_qlinear -> False, which also switches off the one-call
    native decoder), every layer dequantizing per call."""
    if kernel and not native.runs_qlinear(torch.zeros(1)):
        pytest.skip("no quantized linear kernel on this machine")
    if not kernel:
        monkeypatch.setattr(native, "runs_qlinear", lambda x: False)


def assert_logits_match(llm, hf, prompts, atol: float) -> None:
    """Folio's logits within `atol` of transformers' `hf` at every position
    of every prompt."""
    for prompt in prompts:
        assert (folio_logits(llm, prompt) - hf_logits(hf, prompt)).abs().max().item() < atol


def assert_within_the_tools_tolerance(llm, name: str, tolerance: float) -> None:
    """Folio's logits against those the fixture `name` was made with: max
    |difference| within `tolerance` times the largest reference logit, and
    the same top token wherever the reference's top-2 gap is wider than
    twice that difference."""
    for prompt, logits in reference(name):
        ref = logits[:-1]
        ours = folio_logits(llm, prompt)
        diff = (ours - ref).abs().max().item()
        assert diff <= tolerance * ref.abs().max().item()
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * diff
        assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])


def assert_within_bf16_error(llm, hf, prompts, relative: float) -> None:
    """Folio's logits (a bf16 engine) within `relative` times the largest
    of transformers' fp32 logits of them."""
    for prompt in prompts:
        theirs = hf_logits(hf, prompt)
        diff = (folio_logits(llm, prompt) - theirs).abs().max().item()
        assert diff < relative * theirs.abs().max().item()


def assert_greedy_tokens_equal(llm, hf, prompts, what: str) -> None:
    """Folio's 24 greedy tokens of each prompt are transformers' (up to the
    near-ties `assert_greedy_parity` allows)."""
    from folio import SamplingParams
    for prompt in prompts:
        ref, gaps = reference_greedy(hf, prompt, 24, ())
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                           use_tqdm=False)[0]
        assert_greedy_parity(list(out.outputs[0].token_ids), ref, gaps, what)


def assert_tensor_parallel_2_matches(model, prompts, one=None, **engine_args) -> None:
    """The fp32 engine of `model` at tensor-parallel size 2 gives the same 12
    greedy tokens as at size 1 (`one`, an engine already built with the same
    `engine_args`, else one built here), and the same top-5 logprobs of the
    prompt and the output, within 1e-4."""
    from folio import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5,
                            prompt_logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in prompts]
    if one is None:
        one = LLM(str(model), dtype="float32", **FP32, num_kv_blocks=32, **engine_args)
    expect = one.generate(prompts, params, use_tqdm=False)
    two = LLM(str(model), dtype="float32", **FP32, num_kv_blocks=32, tensor_parallel_size=2,
              **engine_args)
    try:
        got = two.generate(prompts, params, use_tqdm=False)
    finally:
        two.shutdown()
    for a, b in zip(expect, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs,
                          b.prompt_logprobs[1:] + b.outputs[0].logprobs):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t] - pb[t]) < 1e-4 for t in pa)


# --------------------------------------------------------------------------- edited copies


def copy_fixture(tmp_path: Path, name: str) -> Path:
    """A copy of the fixture `name` under `tmp_path`, to edit."""
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    return folder


def edit_quantization_config(folder: Path, edit) -> None:
    """Rewrite config.json's quantization_config after `edit(it)` changes it in place."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config["quantization_config"])
    path.write_text(json.dumps(config))


def update_quantization_config(folder: Path, **changes) -> None:
    """Set `changes` in config.json's quantization_config."""
    edit_quantization_config(folder, lambda config: config.update(changes))


def edit_tensors(folder: Path, edit) -> None:
    """Rewrite model.safetensors after `edit(tensors)` changes the dict in place."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
