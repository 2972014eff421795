"""Test helpers: tiny tokenizers and random models written as Hugging Face folders."""

from __future__ import annotations

import json
import os
from pathlib import Path

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "Continuous batching admits new requests the moment there is room.",
    "café naïve résumé — 東京 北京 😀 🚀 12345 67890",
    "def f(x):\n    return x * 2\n\n",
    "Hello, world! How are you today? I am fine, thanks.",
]


def write_tiny_tokenizer(path: str | os.PathLike, vocab_size: int = 384,
                         chat_template: str | None = TINY_CHAT_TEMPLATE) -> None:
    """Train a small byte-level BPE (deterministic) and save it as an HF tokenizer.

    Writes tokenizer.json and tokenizer_config.json (BOS `<s>` added at the start,
    EOS `</s>`, ChatML-style template) into `path`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=TINY_SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": 2048,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
