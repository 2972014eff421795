"""scripts/make_size_ggufs.py's float16 writer (the 1B-8B benchmark files,
written one tensor at a time): on a tiny shape, the file holds every tensor of
the shape in file order, the default model's tokenizer field for field, and
Folio loads and runs it. (llama-quantize, which makes the benchmark's files
from it, is llama.cpp's and is not built here.)"""

import importlib.util
import pathlib

import gguf
import numpy as np

from folio import LLM, SamplingParams
from folio.model.gguf_file import GGUFFile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("make_size_ggufs",
                                                  ROOT / "scripts" / "make_size_ggufs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_tiny_shape_is_written_whole_and_runs(tmp_path, monkeypatch):
    m = _script()
    monkeypatch.setitem(m.SHAPES, "tiny", dict(hidden=128, layers=2, heads=4, kv_heads=2,
                                               ffn=256, tied=False))
    path = tmp_path / "tiny.gguf"
    src = gguf.GGUFReader(m.default_gguf())
    m.write_f16(path, "tiny", src=src)
    r = GGUFFile(str(path))          # Folio's own reader (the gguf package's takes seconds)
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    expected = list(m.tensors_of(m.SHAPES["tiny"], vocab))
    assert [t.name for t in r.tensors] == [name for name, _ in expected]
    for t, (_, shape) in zip(r.tensors, expected):
        assert tuple(reversed(t.shape)) == shape
        data = np.asarray(t.data).astype(np.float32)
        if len(shape) == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32 and (data == 1).all()
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F16
            assert 0.015 < data.std() < 0.025 and abs(data.mean()) < 0.005
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id"):
        assert r.fields[key] == src.fields[key].contents()
    assert r.fields["llama.block_count"] == 2
    llm = LLM(str(path), num_kv_blocks=16)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                       SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
