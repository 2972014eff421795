"""BERT encoders (`BertModel`: sentence-transformers' all-MiniLM-L6-v2 and
its kind), served for embeddings only (`--task embed`).

The graph is transformers' BertModel in inference: word + absolute position
+ token type (0) embeddings and a LayerNorm; per layer, bidirectional
self-attention over the whole input (q, k, v with biases; softmax of q k^T /
sqrt(head_dim)), its output projection, residual and LayerNorm, then the
intermediate projection, exact (erf) GELU, the output projection, residual
and LayerNorm (post-norm). The pooler head is not used (sentence-transformers'
pooling reads the last hidden states).

In the engine an input runs as an embedding request whose prompt is computed
in one step (build_config turns chunked prefill and the prefix cache off for
encoders: a chunk could not see the tokens after it). A step holds whole
inputs one after another, each starting at position 0, which is how the
forward finds them; each attends to itself alone (torch's scaled-dot-product
attention per input). No KV cache is read or written: the engine keeps a
small one (one head, 16 MiB unless told otherwise) for the scheduler's
accounting of the tokens in flight.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from folio.config import ModelConfig
from folio.model.pipeline import StagePlan
from folio.model.shape import ModelShape


def bert_fields(cfg: dict, num_layers: int, source: str) -> dict:
    """config.json's BERT fields -> ModelConfig's: its LayerNorm epsilon (in
    rms_norm_eps, the one norm epsilon a ModelConfig has), its token types,
    and exact GELU (the only activation these checkpoints use)."""
    act = cfg.get("hidden_act", "gelu")
    if act != "gelu":
        raise ValueError(f"{source}: hidden_act {act!r} is not supported for BERT (gelu)")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{source}: position_embedding_type "
                         f"{cfg.get('position_embedding_type')!r} is not supported (absolute)")
    fields = {"rms_norm_eps": float(cfg.get("layer_norm_eps", 1e-12)),
              "type_vocab_size": int(cfg.get("type_vocab_size", 2)), "hidden_act": "gelu",
              "encoder": True}
    if "ForSequenceClassification" in (cfg.get("architectures") or [""])[0]:
        labels = cfg.get("id2label")
        fields["num_labels"] = len(labels) if isinstance(labels, dict) and labels \
            else int(cfg.get("num_labels", 2))
        fields["sep_token_id"] = _sep_id(cfg, source)
    return fields


def _sep_id(cfg: dict, source: str) -> int:
    """[SEP]'s id: config.json's sep_token_id, else the folder's tokenizer.json
    vocabulary's "[SEP]"."""
    if isinstance(cfg.get("sep_token_id"), int):
        return cfg["sep_token_id"]
    try:
        vocab = json.loads((Path(source).parent / "tokenizer.json").read_text())["model"]["vocab"]
        return int(vocab["[SEP]"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"{source}: a cross-encoder needs its [SEP] id (sep_token_id, or "
                         "tokenizer.json's [SEP]) to tell a pair's two texts apart") from None


class _Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.heads, self.head_dim = cfg.num_attention_heads, h // cfg.num_attention_heads
        self.qkv = nn.Linear(h, 3 * h, dtype=dtype)
        self.attn_out = nn.Linear(h, h, dtype=dtype)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.rms_norm_eps, dtype=dtype)
        self.up = nn.Linear(h, i, dtype=dtype)
        self.down = nn.Linear(i, h, dtype=dtype)
        self.out_norm = nn.LayerNorm(h, eps=cfg.rms_norm_eps, dtype=dtype)

    def forward(self, x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        t = x.shape[0]
        # [3, 1, heads, T, head_dim]: torch's fused CPU attention takes 4-D inputs
        # (3-D ones went to its "math" path: a third of the step)
        qkv = self.qkv(x).view(t, 3, self.heads, self.head_dim).permute(1, 2, 0, 3).unsqueeze(1)
        attn = torch.empty_like(x)
        for a, b in spans:      # each input attends to itself, every position to all
            q, k, v = (qkv[i, :, :, a:b] for i in range(3))
            out = F.scaled_dot_product_attention(q, k, v)[0]
            attn[a:b] = out.transpose(0, 1).reshape(b - a, -1)
        x = self.attn_norm(x + self.attn_out(attn))
        return self.out_norm(x + self.down(F.gelu(self.up(x))))


class BertModel(nn.Module):
    # BERT's names -> ours (encoder.layer.{i}. prefix; q, k and v fused on load)
    _NAMES = {"attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
              "intermediate.dense": "up", "output.dense": "down", "output.LayerNorm": "out_norm"}
    _QKV = ("query", "key", "value")
    _SKIP = ("pooler.", "cls.")         # heads this class does not run
    _HEADS: dict[str, str] = {}         # a subclass's head tensors -> its parameters

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: str,
                 quant_config=None, attn_backend=None):
        super().__init__()
        if quant_config is not None and quant_config.name != "none":
            raise ValueError(f"{cfg.model}: a BERT encoder runs in float weights; "
                             f"--quantization {quant_config.name} is not supported for it")
        self.config = cfg
        self.stage = StagePlan.current(cfg.num_hidden_layers)
        if not self.stage.whole:
            raise ValueError("a BERT encoder runs on one pipeline stage")
        h = cfg.hidden_size
        self.word = nn.Embedding(cfg.vocab_size, h, dtype=dtype)
        self.position = nn.Embedding(cfg.max_position_embeddings, h, dtype=dtype)
        self.token_type = nn.Embedding(max(cfg.type_vocab_size, 1), h, dtype=dtype)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.rms_norm_eps, dtype=dtype)
        self.layers = nn.ModuleList(_Layer(cfg, dtype) for _ in range(cfg.num_hidden_layers))
        # a pair's second text's start for each input of the next step (the
        # runner sets it; None for one: after its first [SEP])
        self.second_text_starts: Optional[list[Optional[int]]] = None

    @classmethod
    def shape(cls, cfg: ModelConfig) -> ModelShape:
        return ModelShape.of(cfg)

    @property
    def num_kv_heads_per_rank(self) -> int:
        """The KV cache's heads: one, since nothing is written to it (its blocks
        are the scheduler's bookkeeping of tokens in flight)."""
        return 1

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta,
                intermediate=None) -> torch.Tensor:
        """The last hidden states [T, hidden] of whole inputs laid one after
        another (each from position 0; the KV cache unused)."""
        starts = (positions == 0).nonzero().flatten().tolist() + [positions.shape[0]]
        if starts[0] != 0:
            raise RuntimeError("a BERT encoder computes whole inputs: a step held part of one")
        spans = list(zip(starts[:-1], starts[1:]))
        x = self.word(input_ids) + self.position(positions) + self._token_types(input_ids, spans)
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, spans)
        return x

    def _token_types(self, input_ids: torch.Tensor, spans) -> torch.Tensor:
        """Type 0 everywhere, or for a cross-encoder's pair ([CLS] a [SEP] b
        [SEP]) type 1 from the second text's first token, as its tokenizer
        marks them: where the request says it begins (`second_text_starts`,
        the step's inputs in order, set by the runner), else after the input's
        first [SEP] (a text may hold a literal "[SEP]", which the tokenizer
        reads as the token: the pair's own boundary is the one to trust)."""
        sep = self.config.sep_token_id
        if sep is None or self.config.type_vocab_size < 2:
            return self.token_type.weight[0]
        starts = self.second_text_starts or [None] * len(spans)
        types = torch.zeros_like(input_ids)
        for (a, b), start in zip(spans, starts):
            if start is None:
                hits = (input_ids[a:b] == sep).nonzero()
                start = int(hits[0]) + 1 if hits.numel() else b - a
            types[a + start:b] = 1
        return self.token_type(types)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a BERT encoder has no LM head: it serves embeddings only")

    def build_native_decoder(self) -> None:
        pass

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """BERT's tensors (with or without a `bert.` prefix); the pooler and
        position_ids buffers are not read. Every tensor the graph needs must
        come: the error names the missing ones."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        qkv: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            if name.startswith(self._SKIP) or name.endswith("position_ids"):
                continue
            target = self._target(name, qkv, tensor)
            if target is None:
                continue
            self._copy(params, target, name, tensor)
            loaded.add(target)
        for (i, kind), parts in qkv.items():
            if set(parts) != set(self._QKV):
                missing = sorted(set(self._QKV) - set(parts))
                raise ValueError(f"checkpoint lacks encoder.layer.{i}.attention.self."
                                 f"{missing[0]}.{kind}")
            target = f"layers.{i}.qkv.{kind}"
            self._copy(params, target, f"encoder.layer.{i}.attention.self.*.{kind}",
                       torch.cat([parts[p] for p in self._QKV]))
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {missing[:8]}")

    def _target(self, name: str, qkv: dict, tensor: torch.Tensor) -> Optional[str]:
        """Our parameter of BERT's tensor `name` (None: held for the fused qkv)."""
        direct = {**self._HEADS, "embeddings.word_embeddings.weight": "word.weight",
                  "embeddings.position_embeddings.weight": "position.weight",
                  "embeddings.token_type_embeddings.weight": "token_type.weight",
                  "embeddings.LayerNorm.weight": "embed_norm.weight",
                  "embeddings.LayerNorm.bias": "embed_norm.bias"}
        if name in direct:
            return direct[name]
        if not name.startswith("encoder.layer."):
            raise ValueError(f"checkpoint tensor {name!r} has no parameter in the model")
        rest = name[len("encoder.layer."):]
        index, _, rest = rest.partition(".")
        module, _, kind = rest.rpartition(".")
        if module.startswith("attention.self."):
            part = module[len("attention.self."):]
            if part in self._QKV:
                qkv.setdefault((int(index), kind), {})[part] = tensor
                return None
        if module in self._NAMES:
            return f"layers.{index}.{self._NAMES[module]}.{kind}"
        raise ValueError(f"checkpoint tensor {name!r} has no parameter in the model")

    @staticmethod
    def _copy(params: dict, target: str, name: str, tensor: torch.Tensor) -> None:
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no parameter in the model")
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint tensor of shape {tuple(tensor.shape)} does "
                             f"not fit parameter of shape {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))


class BertForSequenceClassification(BertModel):
    """A cross-encoder (sentence-transformers' CrossEncoder, ms-marco MiniLM &
    co.): BERT over a pair, then its pooler (dense and tanh on the [CLS]
    state) and classifier: `num_labels` logits, served as scores (`--task
    score`: /v1/rerank, /score; LLM.score)."""

    _SKIP = ("cls.",)
    _HEADS = {"pooler.dense.weight": "pooler.weight", "pooler.dense.bias": "pooler.bias",
              "classifier.weight": "classifier.weight", "classifier.bias": "classifier.bias"}

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: str,
                 quant_config=None, attn_backend=None):
        super().__init__(cfg, dtype, device, quant_config, attn_backend)
        self.pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size, dtype=dtype)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels, dtype=dtype)

    def classify(self, cls_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] [CLS] states -> [N, num_labels] logits."""
        return self.classifier(torch.tanh(self.pooler(cls_states)))
