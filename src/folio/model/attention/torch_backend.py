"""Portable paged attention in plain PyTorch ("TORCH_SDPA"): any device, any dtype.

Decodes run batched with no per-sequence Python loop: keys and values are
gathered through the block tables into a padded [B, max_context] view and
masked by each sequence's context length. Prefill chunks run one SDPA call per
sequence: `is_causal` for a chunk that starts the sequence, otherwise a mask
built from absolute positions (SDPA's `is_causal` aligns the triangle to the
top-left, which is wrong once a sequence resumes mid-prompt with keys before
its first query). A sliding-window layer masks the keys at or before
position - window as well, and reads only the blocks its window touches. A
cache narrower than the queries (fp32 run, `--kv-cache-dtype bfloat16`) is
read widened to the queries' dtype, and a
whole prompt's own keys and values are rounded to the cache's dtype first, so
every token sees the keys as the cache holds them, as the native kernel does.
An 8-bit cache (`--kv-cache-dtype int8|fp8`, kv_quant.py) is written quantized,
each row with its scale, and read dequantized in the same places.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from folio.model.attention import kv_quant
from folio.model.attention.backend import AttentionBackend, StepDescription, padded_tables
from folio.model.attention.metadata import AttentionMetadata, PrefillSpan


def _tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(a).to(device)


class TorchAttentionBackend(AttentionBackend):
    name = "TORCH_SDPA"
    supports_sliding_window = True
    reads_8bit_kv = ("int8", "fp8", "fp8_e5m2")

    @classmethod
    def supports(cls, device, dtype):
        return True

    @classmethod
    def build_metadata(cls, step: StepDescription) -> AttentionMetadata:
        meta = cls._per_kind(step)
        if meta.num_decodes:
            d = meta.num_decodes
            meta.decode_block_tables = _tensor(padded_tables(step)[:d], step.device)
            meta.decode_context_lens = _tensor(step.positions[:d] + 1, step.device)
        return meta

    @staticmethod
    def _per_kind(step: StepDescription) -> AttentionMetadata:
        """The slots and the prefill spans (the decode rows are the caller's)."""
        def tensor(a: np.ndarray) -> torch.Tensor:
            return _tensor(a, step.device)
        d, prefills, row = step.num_decodes, [], 0
        for i, (n, start) in enumerate(zip(step.query_lens, step.start_positions)):
            if i >= d:
                prefills.append(PrefillSpan(row, n, start, tensor(step.block_tables[i])))
            row += n
        return AttentionMetadata(slot_mapping=tensor(step.slot_mapping), num_decodes=d,
                                 prefills=prefills)

    def write_kv(self, k, v, kv_cache, meta: AttentionMetadata) -> None:
        width = kv_cache.shape[-1]          # head_dim, and an 8-bit row's scale
        # torch copies e5m2 rows as their bytes (index_copy_ has no float8 kernel)
        raw = (lambda t: t.view(torch.uint8)) if kv_cache.dtype == torch.float8_e5m2 \
            else (lambda t: t)
        flat_k = raw(kv_cache[0]).view(-1, self.num_kv_heads, width)
        flat_v = raw(kv_cache[1]).view(-1, self.num_kv_heads, width)
        flat_k.index_copy_(0, meta.slot_mapping,
                           raw(kv_quant.stored(k, kv_cache.dtype, self.static_scale(0))))
        flat_v.index_copy_(0, meta.slot_mapping,
                           raw(kv_quant.stored(v, kv_cache.dtype, self.static_scale(1))))

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata):
        self.write_kv(k, v, kv_cache, meta)
        return self.attend(q, k, v, kv_cache, meta)

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata):
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        out = torch.empty_like(q)
        d = meta.num_decodes
        if d:
            out[:d] = self._decode(q[:d], k_cache, v_cache, meta)
        for span in meta.prefills:
            rows = slice(span.token_start, span.token_start + span.num_tokens)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, span)
        return out

    def _window_blocks(self, tables: torch.Tensor, ends: torch.Tensor, block_size: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """A windowed layer's decode reads the blocks its window touches only:
        (each row's tables from its first such block, that block's first
        position). Rows whose context is shorter keep their whole table."""
        count = -(-self.sliding_window // block_size) + 1       # a window straddles blocks
        if count >= tables.shape[1]:
            return tables, torch.zeros_like(ends)
        first = (ends - self.sliding_window).clamp(min=0) // block_size        # [B]
        # columns past the table repeat its last block: their positions lie
        # past the context, masked
        cols = (first[:, None] + torch.arange(count, device=tables.device)).clamp(
            max=tables.shape[1] - 1)
        return tables.gather(1, cols), first * block_size

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        b, hkv, dim, width = q.shape[0], self.num_kv_heads, self.head_dim, k_cache.shape[-1]
        tables, ends = meta.decode_block_tables, meta.decode_context_lens      # [B, MB], [B]
        offsets = None
        if self.sliding_window is not None:
            tables, offsets = self._window_blocks(tables, ends, k_cache.shape[1])
        keys = kv_quant.read(k_cache[tables].view(b, -1, hkv, width), q.dtype)  # [B, L, Hkv, D]
        values = kv_quant.read(v_cache[tables].view(b, -1, hkv, width), q.dtype)
        qg = q.view(b, hkv, -1, dim)                               # [B, Hkv, G, D]
        scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)).float() * self.scale  # [B, Hkv, G, L]
        positions = torch.arange(keys.shape[1], device=q.device)[None, :]       # [1, L]
        if offsets is not None:
            positions = positions + offsets[:, None]                            # [B, L]
        invalid = positions >= ends[:, None]                                    # [B, L]
        if self.sliding_window is not None:
            invalid |= positions < (ends - self.sliding_window)[:, None]
        scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = torch.matmul(probs, values.transpose(1, 2))          # [B, Hkv, G, D]
        return out.reshape(b, -1, dim)

    def _prefill(self, q, k, v, k_cache, v_cache, span: PrefillSpan) -> torch.Tensor:
        n, ctx = span.num_tokens, span.start_pos + span.num_tokens
        # 4-D inputs with grouped heads: torch's CPU flash-attention kernel takes
        # them (3-D ones fall to the unfused math path, 2.5x slower here).
        q4 = q.transpose(0, 1)[None]                                 # [1, H, n, D]
        window = self.sliding_window
        if span.start_pos == 0 and (window is None or window >= n):
            # a whole prompt, every key in the window: the plain causal triangle
            if k_cache.dtype != q.dtype:           # as the cache holds them
                k = kv_quant.as_stored(k, k_cache.dtype, q.dtype, self.static_scale(0))
                v = kv_quant.as_stored(v, k_cache.dtype, q.dtype, self.static_scale(1))
            out = F.scaled_dot_product_attention(
                q4, k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True,
                scale=self.scale, enable_gqa=True)
            return out[0].transpose(0, 1)
        # a later chunk: earlier keys live only in the cache (a windowed layer's
        # from the block of its first query's window on)
        bs = k_cache.shape[1]
        skip = 0 if window is None else max(0, span.start_pos - window + 1) // bs
        table = span.block_table[skip:]
        k = kv_quant.read(k_cache[table].flatten(0, 1)[:ctx - skip * bs], q.dtype)
        v = kv_quant.read(v_cache[table].flatten(0, 1)[:ctx - skip * bs], q.dtype)
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        query_pos = span.start_pos + torch.arange(n, device=q.device)
        key_pos = skip * bs + torch.arange(ctx - skip * bs, device=q.device)[None, :]
        mask = key_pos <= query_pos[:, None]                                      # [n, ctx]
        if window is not None:
            mask &= key_pos > query_pos[:, None] - window
        out = F.scaled_dot_product_attention(q4, k, v, attn_mask=mask[None, None],
                                             scale=self.scale, enable_gqa=True)  # [1, H, n, D]
        return out[0].transpose(0, 1)

