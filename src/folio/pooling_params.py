"""PoolingParams: how one embedding request reduces its prompt's hidden
states to a vector, validated up front (vLLM's names: `LLM.embed(prompts,
pooling_params=PoolingParams(...))`).

An embedding request is its prompt only: the model runs over it (in chunks
under the step's token budget, like any prompt), the final layer's hidden
states of its positions are pooled, and the request ends with the vector,
its blocks freed; no token is sampled and the LM head is not run.

- `pooling`: "last" (the last position's state: decoder embedding models,
  Qwen3-Embedding's way), "mean" (the mean over every position:
  sentence-transformers' default), "cls" (the first position's) or
  "classify" (a cross-encoder's logits from its first position: its pooler
  and classifier; what scores are made of); None: the model's own ("classify"
  for a cross-encoder, else its sentence-transformers pooling config where
  the folder has one, else "last");
- `normalize`: divide by the L2 norm (None: the model's own: a
  sentence-transformers Normalize module, else True);
- `dimensions`: keep the first this many values (Matryoshka embeddings),
  before normalizing; None: all;
- `second_text_start`: a cross-encoder's pair, the position of the second
  text's first token (its tokens are of type 1, as the tokenizer's pair
  encoding marks them; `LLM.score` and the server's score and rerank set it);
  None: type 1 after the input's first [SEP].
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

POOLING_TYPES = ("last", "mean", "cls", "classify")


@dataclass(frozen=True)
class PoolingParams:
    pooling: Optional[str] = None
    normalize: Optional[bool] = None
    dimensions: Optional[int] = None
    second_text_start: Optional[int] = None

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got "
                             f"{self.pooling!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool)
                                            or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        start = self.second_text_start
        if start is not None and (isinstance(start, bool) or not isinstance(start, int)
                                  or start < 1):
            raise ValueError(f"second_text_start must be a positive integer, got {start!r}")

    def resolved(self, default: "PoolingParams", hidden_size: int) -> "PoolingParams":
        """These params with the model's defaults where unset, checked against
        the model's width."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(f"dimensions={self.dimensions} is more than the model's "
                             f"{hidden_size}")
        return replace(self, pooling=self.pooling or default.pooling or "last",
                       normalize=(self.normalize if self.normalize is not None
                                  else default.normalize if default.normalize is not None
                                  else True))


def model_pooling(folder: Optional[str]) -> PoolingParams:
    """A checkpoint folder's own pooling, from its sentence-transformers files
    (modules.json naming a Pooling module whose config.json sets its mode, and
    a Normalize module or not); defaults (None fields) without them."""
    if folder is None or not Path(folder).is_dir():
        return PoolingParams()
    root = Path(folder)
    try:
        modules = json.loads((root / "modules.json").read_text())
    except (OSError, ValueError):
        return PoolingParams()
    pooling, normalize = None, False
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", ""))
        if kind.endswith("Normalize"):
            normalize = True
        elif kind.endswith("Pooling"):
            try:
                config = json.loads((root / module.get("path", "") / "config.json").read_text())
            except (OSError, ValueError):
                continue
            for key in _UNSUPPORTED_MODES:
                if config.get(key):
                    raise ValueError(f"{folder}: sentence-transformers pooling {key} is not "
                                     "supported; supported: mean, cls, last token")
            for key, name in (("pooling_mode_lasttoken", "last"),
                              ("pooling_mode_mean_tokens", "mean"),
                              ("pooling_mode_cls_token", "cls")):
                if config.get(key):
                    pooling = name
                    break
        elif not kind.endswith("Transformer"):
            raise ValueError(f"{folder}: sentence-transformers module {kind!r} is not "
                             "supported (Transformer, Pooling and Normalize are)")
    return PoolingParams(pooling=pooling, normalize=normalize)


_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens")


def sigmoid(x: float) -> float:
    """A cross-encoder's score of its one logit: 1 / (1 + e^-x), without
    overflow for large |x|."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)
