"""Sampling defaults for `folio chat`: the checkpoint's own, else Folio's.

A Hugging Face checkpoint may ship `generation_config.json` with the sampling
its authors tuned the model for (temperature, top_p, top_k, repetition_penalty,
max_new_tokens); vLLM applies it too. Greedy decoding of a small chat model
falls into repetition loops, so a chat without such a file samples with
CHAT_DEFAULTS.
GGUF files (the default model among them) carry no sampling settings.
No torch here: the defaults are read and checked before the model loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

# Used where the checkpoint says nothing; a reply is capped so that a loop ends.
CHAT_DEFAULTS: dict[str, Any] = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 512}

# generation_config.json key -> SamplingParams field
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
           "min_p": "min_p", "repetition_penalty": "repetition_penalty",
           "max_new_tokens": "max_tokens"}


def read_generation_config(model: Optional[str]) -> dict[str, Any]:
    """SamplingParams fields set by the model folder's generation_config.json ({} if none).

    `do_sample: false` means greedy in transformers, so it sets temperature 0.
    """
    path = _config_path(model)
    if path is None:
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from err
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    values = {field: config[key] for key, field in _FIELDS.items() if config.get(key) is not None}
    if config.get("do_sample") is False:
        values["temperature"] = 0.0
    _check(values, path)
    return values


def chat_defaults(model: Optional[str]) -> dict[str, Any]:
    """The model's sampling defaults over Folio's chat defaults."""
    return {**CHAT_DEFAULTS, **read_generation_config(model)}


def _config_path(model: Optional[str]) -> Optional[Path]:
    if model is None:
        return None
    path = Path(model).expanduser() / "generation_config.json"
    return path if path.is_file() else None


def _check(values: dict[str, Any], path: Path) -> None:
    # SamplingParams names the field; the path says which file to fix.
    from folio.sampling_params import SamplingParams
    try:
        SamplingParams(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from err
