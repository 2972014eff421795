"""Random-weight GGUFs of the shapes people run on a CPU (issue 53): Llama-3.2-1B,
Llama-3.2-3B and Llama-3.1-8B, written as float16 by the gguf package's writer
one tensor at a time (never the model in memory at once), then quantized by
llama.cpp's own `llama-quantize` (scripts/install_llama_cpp.sh builds it) to
each type asked for. The float16 file is deleted after its quantizations
unless --keep-f16.

The tokenizer is SmolLM2's (the default model's GGUF, 49,152 tokens, copied
field by field), so the embedding and LM head are 49,152 rows rather than
Llama 3's 128,256: the layers are the real models' shapes, the head smaller.
The weights are N(0, 0.02) from a seeded generator: the tokens they make mean
nothing, the bytes a step reads are a real model's.

    .venv/bin/python scripts/make_size_ggufs.py OUT_DIR [--sizes 1b,3b,8b]
        [--types Q4_K_M,Q8_0] [--keep-f16]

writes OUT_DIR/llama-<size>-<type>.gguf, skipping files already there.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# hidden, layers, query heads, KV heads, MLP width, tied embeddings
SHAPES = {
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, tied=True),
    "3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, tied=True),
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, tied=False),
}


def default_gguf() -> str:
    sys.path.insert(0, str(ROOT / "src"))
    from folio.model.loader import _default_gguf_path
    return _default_gguf_path()


def tensors_of(shape: dict, vocab: int):
    """(name, numpy shape (out, in)) of every tensor, in file order."""
    h, kv_dim = shape["hidden"], shape["kv_heads"] * (shape["hidden"] // shape["heads"])
    yield "token_embd.weight", (vocab, h)
    for i in range(shape["layers"]):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (h,)
        yield b + "attn_q.weight", (h, h)
        yield b + "attn_k.weight", (kv_dim, h)
        yield b + "attn_v.weight", (kv_dim, h)
        yield b + "attn_output.weight", (h, h)
        yield b + "ffn_norm.weight", (h,)
        yield b + "ffn_gate.weight", (shape["ffn"], h)
        yield b + "ffn_up.weight", (shape["ffn"], h)
        yield b + "ffn_down.weight", (h, shape["ffn"])
    yield "output_norm.weight", (h,)
    if not shape["tied"]:
        yield "output.weight", (vocab, h)


def write_f16(path: Path, size: str, seed: int = 0, src=None) -> None:
    """`src`: the gguf.GGUFReader whose tokenizer the file takes (default:
    the default model's; reading it takes seconds)."""
    import gguf
    shape = SHAPES[size]
    src = src or gguf.GGUFReader(default_gguf())
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"random Llama {size.upper()} shape (Folio issue 53)")
    w.add_block_count(shape["layers"])
    w.add_context_length(8192)
    w.add_embedding_length(shape["hidden"])
    w.add_feed_forward_length(shape["ffn"])
    w.add_head_count(shape["heads"])
    w.add_head_count_kv(shape["kv_heads"])
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(shape["hidden"] // shape["heads"])
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, field in src.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub)
    specs = list(tensors_of(shape, vocab))
    for name, shp in specs:
        dtype = np.float32 if len(shp) == 1 else np.float16
        w.add_tensor_info(name, shp, np.dtype(dtype), int(np.prod(shp)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shp in specs:
        if len(shp) == 1:
            w.write_tensor_data(np.ones(shp, np.float32))
            continue
        data = np.empty(shp, np.float16)
        step = max(1, (1 << 24) // shp[1])        # ~16M values at a time
        for r in range(0, shp[0], step):
            chunk = rng.standard_normal((min(step, shp[0] - r), shp[1]), dtype=np.float32)
            data[r:r + len(chunk)] = chunk * 0.02
        w.write_tensor_data(data)
        del data
    w.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--sizes", default="1b,3b,8b")
    p.add_argument("--types", default="Q4_K_M,Q8_0")
    p.add_argument("--isa", default="native", help="which llama.cpp build's llama-quantize")
    p.add_argument("--keep-f16", action="store_true")
    args = p.parse_args()
    quantize = ROOT / "build" / "llama.cpp" / args.isa / "bin" / "llama-quantize"
    if not quantize.exists():
        sys.exit(f"no {quantize}: run scripts/install_llama_cpp.sh {args.isa} first")
    args.out.mkdir(parents=True, exist_ok=True)
    for size in args.sizes.split(","):
        todo = [t for t in args.types.split(",")
                if not (args.out / f"llama-{size}-{t}.gguf").exists()]
        if not todo:
            continue
        f16 = args.out / f"llama-{size}-F16.gguf"
        if not f16.exists():
            print(f"writing {f16}", flush=True)
            write_f16(f16.with_suffix(".part"), size)
            os.replace(f16.with_suffix(".part"), f16)
        for t in todo:
            out = args.out / f"llama-{size}-{t}.gguf"
            print(f"quantizing {out}", flush=True)
            done = subprocess.run([str(quantize), str(f16), str(out.with_suffix(".part")), t,
                                   str(os.cpu_count())], capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"llama-quantize failed:\n{done.stderr[-3000:]}")
            os.replace(out.with_suffix(".part"), out)
        if not args.keep_f16:
            f16.unlink()


if __name__ == "__main__":
    main()
