"""Tokenizers from a Hugging Face folder or from GGUF metadata.

Both paths end in one `tokenizers.Tokenizer` (the Rust fast tokenizer) plus the
few facts the engine needs: special token ids, whether BOS is added, the chat
template. Encoding and decoding are the Rust tokenizer's, so ids match
`transformers.AutoTokenizer` token for token; what this module decides is how
the Rust tokenizer is configured, which is where the two could drift:

- HF folders follow transformers' fast-tokenizer rules (`TokenizersBackend`,
  transformers 5): the named special tokens and `added_tokens_decoder` entries
  of tokenizer_config.json are registered as added tokens, and tokenizer.json's
  post-processor decides whether BOS/EOS are added (transformers drops the
  config's `add_bos_token` / `add_eos_token` when tokenizer.json exists).
  Model-specific tokenizer classes that rebuild the pipeline in Python
  (e.g. transformers' LlamaTokenizer for SentencePiece models) are not
  mirrored: tokenizer.json is taken as the truth.
- GGUF files carry vocabulary, merges and token types but no pre-tokenizer, only
  its llama.cpp name (`tokenizer.ggml.pre`); `_GGUF_PRE_TOKENIZERS` maps names
  to the splitting the original tokenizer.json does. For SmolLM ('smollm') that
  is digits split one by one, then GPT-2's byte-level regex -- transformers'
  own GGUF conversion omits the digit split and so differs from the real
  tokenizer on text such as " ½" or "a  1" (tests/test_tokenizer.py checks
  llama.cpp's reference encodings, made with the real tokenizer).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterable, Mapping, Optional, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _RustTokenizer

from folio.chat_template import render_chat

logger = logging.getLogger(__name__)

_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")

# GGUF token types (llama.cpp's llama_token_type).
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4

# Pre-tokenizer regexes, as the models' tokenizer.json files state them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level(use_regex: bool = True):
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _split_then_bytes(regex: str):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"), _byte_level(use_regex=False)])


def _digits_then_gpt2():
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


# llama.cpp pre-tokenizer name -> the original tokenizer.json's pre-tokenizer.
_GGUF_PRE_TOKENIZERS = {
    "smollm": _digits_then_gpt2, "starcoder": _digits_then_gpt2,
    "gpt2": _byte_level,
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama-v3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "smaug-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
}


class Tokenizer:
    """Text <-> token ids, special tokens and chat template of one model."""

    def __init__(self, backend: _RustTokenizer, *, special_tokens: Mapping[str, Optional[str]],
                 extra_eos_token_ids: Iterable[int] = (),
                 chat_templates: Optional[Mapping[str, str]] = None, source: str = ""):
        self._backend = backend
        self.source = source
        self.special_tokens = {k: special_tokens.get(k) for k in _NAMED_SPECIALS}
        self.bos_token_id = self._id_of(self.special_tokens["bos_token"])
        self.pad_token_id = self._id_of(self.special_tokens["pad_token"])
        eos = [self._id_of(self.special_tokens["eos_token"]), *extra_eos_token_ids]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos if i is not None))
        self.chat_templates = dict(chat_templates or {})
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        # Exactly what decode(skip_special_tokens=True) drops (the named special
        # tokens are registered as special added tokens by both loaders).
        self.all_special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
        self.add_bos_token: bool = self._probe_adds_bos()
        # <0xNN> tokens of SentencePiece-style vocabularies, when the decoder
        # turns them back into bytes (the incremental detokenizer needs them).
        byte_fallback = backend.decoder is not None and b"ByteFallback" in backend.decoder.__getstate__()
        self.byte_fallback_ids = frozenset(
            i for t, i in backend.get_vocab().items()
            if len(t) == 6 and t.startswith("<0x") and t.endswith(">")) if byte_fallback else frozenset()

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_hf_folder(cls, path: str) -> "Tokenizer":
        """tokenizer.json + tokenizer_config.json (+ chat_template.jinja, generation_config.json)."""
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ValueError(
                f"no tokenizer.json in {path!r}: Folio needs the fast (Rust) tokenizer file; "
                "save one with transformers' `AutoTokenizer.from_pretrained(...).save_pretrained(...)`")
        try:
            backend = _RustTokenizer.from_file(tok_file)
        except Exception as e:      # noqa: BLE001 - the Rust library raises a bare Exception
            raise ValueError(f"cannot read the tokenizer {tok_file}: {e}") from e
        # One text's ids, whole: a file saved with fixed padding or truncation
        # (sentence-transformers' all-MiniLM pads every input to 128 and cuts
        # it there) would otherwise pad or cut every prompt; a too long input
        # is refused by length instead, naming max_model_len
        backend.no_padding()
        backend.no_truncation()
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        specials = {k: _token_content(config.get(k)) for k in _NAMED_SPECIALS}
        _register_added_tokens(backend, config, specials)
        # As in transformers, tokenizer.json's post-processor alone decides which
        # special tokens encode() adds; the config's add_bos_token is ignored.
        if backend.post_processor is None:
            backend.post_processor = _bos_eos_processor(backend, specials, False, False)
        gen = _read_json(os.path.join(path, "generation_config.json"))
        extra_eos = gen.get("eos_token_id")
        extra_eos = [extra_eos] if isinstance(extra_eos, int) else list(extra_eos or [])
        return cls(backend, special_tokens=specials, extra_eos_token_ids=extra_eos,
                   chat_templates=_hf_chat_templates(path, config), source=path)

    @classmethod
    def from_gguf(cls, path: str) -> "Tokenizer":
        """Byte-level BPE from a GGUF file's `tokenizer.ggml.*` metadata."""
        meta = _read_gguf_tokenizer_metadata(path)
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"{path}: tokenizer.ggml.model is {kind!r}; only byte-level BPE "
                             "('gpt2') GGUF tokenizers are supported, use the HF folder instead")
        tokens = meta["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        backend = _RustTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
        backend.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"), path)
        backend.decoder = decoders.ByteLevel()
        _register_gguf_token_types(backend, tokens, meta.get("tokenizer.ggml.token_type") or [])

        def token(key: str) -> Optional[str]:
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        specials = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                    "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")}
        # transformers registers these as special even when the file types them otherwise.
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                    for t in dict.fromkeys(specials.values()) if t is not None])
        backend.post_processor = _bos_eos_processor(
            backend, specials, bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            bool(meta.get("tokenizer.ggml.add_eos_token", False)))
        eot = meta.get("tokenizer.ggml.eot_token_id")
        template = meta.get("tokenizer.chat_template")
        return cls(backend, special_tokens=specials, extra_eos_token_ids=[eot] if eot is not None else [],
                   chat_templates={"default": template} if template else None, source=path)

    # ------------------------------------------------------------- properties
    @property
    def bos_token(self) -> Optional[str]:
        return self.special_tokens["bos_token"]

    @property
    def eos_token(self) -> Optional[str]:
        return self.special_tokens["eos_token"]

    @property
    def chat_template(self) -> Optional[str]:
        return self.chat_templates.get("default")

    def _id_of(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self._backend.token_to_id(token)

    def _probe_adds_bos(self) -> bool:
        # Ask the post-processor rather than trusting a config flag: it is what encode() runs.
        with_special = self._backend.encode("a", add_special_tokens=True).ids
        return bool(with_special) and with_special[0] == self.bos_token_id and \
            len(with_special) > len(self._backend.encode("a", add_special_tokens=False).ids)

    # ---------------------------------------------------------- text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > 2048:
            # the batch call lets go of the GIL while it works (encode holds it:
            # a megabyte of text stalled the server's event loop for a second)
            return self._backend.encode_batch([text],
                                              add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, first: str, second: str) -> tuple[list[int], int]:
        """Two texts as one input, as the tokenizer's post-processor joins a
        pair (a cross-encoder's: [CLS] first [SEP] second [SEP]), and where
        the second text's part begins (its first token of type 1; the
        input's length if none is)."""
        enc = self._backend.encode_batch([(first, second)])[0]
        return enc.ids, next((i for i, t in enumerate(enc.type_ids) if t == 1), len(enc.ids))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[Optional[str]]:
        return [self._backend.id_to_token(i) for i in ids]

    # ---------------------------------------------------------------- chats
    def apply_chat_template(self, messages, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, chat_template: Optional[str] = None,
                            tools: Optional[list] = None, **kwargs: Any) -> str:
        """Render a conversation to prompt text, as transformers' apply_chat_template(tokenize=False)."""
        template = self._pick_template(chat_template, tools)
        return render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, tools=tools,
                           special_tokens=self.special_tokens, **kwargs)

    def encode_chat(self, messages, **kwargs: Any) -> list[int]:
        """Render, then tokenize; BOS is added only if the template did not write it already."""
        text = self.apply_chat_template(messages, **kwargs)
        ids = self.encode(text, add_special_tokens=False)
        template_wrote_bos = self.bos_token is not None and text.startswith(self.bos_token)
        if self.add_bos_token and not template_wrote_bos:
            ids.insert(0, self.bos_token_id)
        return ids

    def _pick_template(self, chat_template: Optional[str], tools: Optional[list]) -> str:
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if self.chat_template is None:
            raise ValueError(
                f"the model {self.source!r} has no chat template, so chat messages cannot be "
                "turned into a prompt: pass one as chat_template=... (a Jinja template string; "
                "`--chat-template FILE` on the command line), or send a plain text prompt")
        return self.chat_template

    def __repr__(self) -> str:
        return (f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_token_id}, eos={self.eos_token_ids}, add_bos={self.add_bos_token})")


def get_tokenizer(model_config) -> Tokenizer:
    """The tokenizer for a `folio.config.ModelConfig` (format "hf" or "gguf"),
    or of the folder or file its `tokenizer` names (--tokenizer)."""
    other = getattr(model_config, "tokenizer", None)
    if other is not None:
        return Tokenizer.from_gguf(other) if other.endswith(".gguf") else \
            Tokenizer.from_hf_folder(other)
    if model_config.format == "hf":
        return Tokenizer.from_hf_folder(model_config.path)
    if model_config.format == "gguf":
        return Tokenizer.from_gguf(model_config.path)
    raise ValueError(f"unknown model format {model_config.format!r} (expected 'hf' or 'gguf')")


# ------------------------------------------------------------------ HF helpers
def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _added_token(value: Any, special: bool) -> Optional[AddedToken]:
    if isinstance(value, Mapping):
        if value.get("content") is None:
            return None
        return AddedToken(value["content"], single_word=value.get("single_word", False),
                          lstrip=value.get("lstrip", False), rstrip=value.get("rstrip", False),
                          normalized=value.get("normalized", not special),
                          special=value.get("special", special))
    return AddedToken(value, normalized=False, special=special) if isinstance(value, str) else None


def _register_added_tokens(backend: _RustTokenizer, config: Mapping, specials: Mapping) -> None:
    """Make the config's added and special tokens whole, matchable tokens, as transformers does."""
    known = {t.content for t in backend.get_added_tokens_decoder().values()}
    decoder = config.get("added_tokens_decoder") or {}
    missing = [(int(i), v) for i, v in decoder.items() if _token_content(v) not in known]
    for _, value in sorted(missing, key=lambda item: item[0]):
        token = _added_token(value, special=bool(value.get("special", False)))
        if token is not None:
            backend.add_tokens([token])
    extras = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    if isinstance(extras, Mapping):
        extras = list(extras.values())
    named = [config.get(k) for k in _NAMED_SPECIALS if specials.get(k) is not None]
    tokens = [t for t in (_added_token(v, special=True) for v in [*named, *extras]) if t is not None]
    if tokens:
        backend.add_special_tokens(tokens)


def _bos_eos_processor(backend: _RustTokenizer, specials: Mapping, add_bos: bool, add_eos: bool):
    bos, eos = specials.get("bos_token"), specials.get("eos_token")
    add_bos = add_bos and bos is not None and backend.token_to_id(bos) is not None
    add_eos = add_eos and eos is not None and backend.token_to_id(eos) is not None
    single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
    pair = single + " " + " ".join([f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos)
    used = [t for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, backend.token_to_id(t)) for t in dict.fromkeys(used)])


def _hf_chat_templates(path: str, config: Mapping) -> dict[str, str]:
    """Named templates. Template files (chat_template.jinja is "default",
    additional_chat_templates/NAME.jinja is NAME) replace the config's, as in transformers."""
    files = {"default": os.path.join(path, "chat_template.jinja")}
    extra_dir = os.path.join(path, "additional_chat_templates")
    if os.path.isdir(extra_dir):
        files.update({name[:-len(".jinja")]: os.path.join(extra_dir, name)
                      for name in sorted(os.listdir(extra_dir)) if name.endswith(".jinja")})
    templates = {}
    for name, file in files.items():
        if os.path.isfile(file):
            with open(file, encoding="utf-8") as f:
                templates[name] = f.read()
    if templates:
        return templates
    value = config.get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):         # [{"name": "default", "template": "..."}, ...]
        return {t["name"]: t["template"] for t in value if "name" in t and "template" in t}
    return {}


# ---------------------------------------------------------------- GGUF helpers
def _read_gguf_tokenizer_metadata(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file not found: {path!r}")
    # The loader's cached reader: the model config and weights read the same file.
    from folio.model.gguf_loader import gguf_reader

    reader = gguf_reader(path)
    return {name: value for name, value in reader.fields.items()
            if name.startswith("tokenizer.")}


def _gguf_pre_tokenizer(name: Optional[str], path: str):
    factory = _GGUF_PRE_TOKENIZERS.get(name or "")
    if factory is None:
        logger.warning("%s: unknown tokenizer.ggml.pre %r; splitting text like GPT-2, "
                       "which may not match the original tokenizer", path, name)
        factory = _byte_level
    return factory()


def _register_gguf_token_types(backend: _RustTokenizer, tokens: Sequence[str],
                               token_types: Sequence[int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens.

    Either way they are matched whole in the text, as llama.cpp and the original
    tokenizer.json do; only special ones are dropped by skip_special_tokens.
    """
    control, user = [], []
    for token, kind in zip(tokens, token_types):
        if kind == _GGUF_CONTROL:
            control.append(AddedToken(token, normalized=False, special=True))
        elif kind == _GGUF_USER_DEFINED:
            user.append(AddedToken(token, normalized=False, special=False))
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)
