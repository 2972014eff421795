"""Helpers for the quantized checkpoints of tests/fixtures/quant: their
transformers reference logits, an exact float copy (the format's formula
applied by this test code, not Folio's) and Folio's own logits."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "quant"


def reference(name: str) -> list[tuple[list[int], torch.Tensor]]:
    ref = load_file(str(FIXTURES / name / "reference.safetensors"))
    return [(ref[f"prompt.{i}"].tolist(), ref[f"logits.{i}"])
            for i in range(len([k for k in ref if k.startswith("prompt.")]))]


def write_float_copy(name: str, dequantize, out: Path) -> Path:
    """The checkpoint with every quantized layer replaced by the float weight
    `dequantize(tensors, prefix)` gives: a plain HF folder."""
    from safetensors.torch import save_file
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
