"""Paged attention over a flattened batch.

The batch is laid out as [decode tokens | prefill chunks]: sequences that feed one token this step
come first and are handled together by a paged decode kernel (C++ on the CPU, the torch reference
elsewhere); each prefill chunk then attends causally to its cached context plus itself (in bfloat16 on an
AVX512-BF16 CPU without AMX: csrc/prefill_attention.cpp, straight from the pool; else torch's attention over the
gathered context). New keys and values are written into the pool at `slot_mapping` before attention reads it.

A sliding-window layer (Mistral's `sliding_window`) passes `window`: the query at position p then sees
only keys p - window + 1 .. p, as HF masks them. Positions are measured in the block table, which is
exact because a windowed table is contiguous over at least its last `window` keys (the KV cache
manager frees only blocks the window has passed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llmaccel.ops.cpu_kernels import load_cpu_kernels
from llmaccel.ops.kv_int8 import loaded, stored
from llmaccel.platform import cpu_features


@dataclass
class PrefillSpan:
    """One sequence's chunk of `num_tokens` query tokens, ending at `context_len` keys in all."""

    start: int  # offset of the chunk in the flattened batch
    num_tokens: int
    context_len: int
    context_slots: torch.Tensor | None  # slots of all context_len keys; None when the chunk is the whole context


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes in the pool
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [D] int32
    prefills: list[PrefillSpan] = field(default_factory=list)
    block_size: int = 16
    decode_max_len: int = 0  # the longest decode context, known on the host (no device sync to find it)
    # decode rows include successive positions of one sequence (speculative verification): every row's
    # K/V must be in the pool before any row attends (the layer-by-layer paths always write first)
    decode_kv_first: bool = False
    # the torch decode path's gather (slots, mask) per window, built at the first layer, reused by the rest
    decode_gathers: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def decode_gather(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, max_len: int,
                  window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool slot of every key position of every decoding sequence, [S, max_len], padded with a real
    slot, and which of them each query sees (its context, and only its window)."""
    positions = torch.arange(max_len, device=block_tables.device)
    blocks = block_tables.long()[:, positions // block_size]
    slots = blocks * block_size + positions % block_size
    lens = context_lens[:, None].long()
    valid = positions[None, :] < lens
    if window is not None:
        valid &= positions[None, :] >= lens - window
    return torch.where(valid, slots, slots[:, :1]), valid  # padding reads a real slot: finite, masked out


def reference_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                               scale: float, window: int | None = None) -> torch.Tensor:
    """Plain torch: gather each sequence's keys by slot, pad, mask, SDPA. q: [S, H, D]."""
    gather = decode_gather(block_tables, context_lens, block_size, int(context_lens.max()), window)
    return gathered_decode_attention(q, k_cache, v_cache, gather, scale)


def gathered_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              gather: tuple[torch.Tensor, torch.Tensor], scale: float,
                              softcap: float | None = None) -> torch.Tensor:
    """Decode attention over the slots and mask of `decode_gather`. q: [S, H, D]."""
    slots, valid = gather
    keys = loaded(k_cache[slots], q.dtype).transpose(1, 2)  # [S, KVH, L, D]
    values = loaded(v_cache[slots], q.dtype).transpose(1, 2)
    if softcap is not None:
        return softcapped_attention(q.unsqueeze(2), keys, values, valid[:, None, None, :], scale, softcap).squeeze(2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=valid[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2)


def softcapped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                         scale: float, cap: float) -> torch.Tensor:
    """Attention with the scores capped, cap * tanh(s / cap), before the softmax (Gemma 2), as HF's eager
    path computes it: q [B, H, n, D], keys/values [B, KVH, L, D], mask [B, 1, n, L] (True: seen) or None
    for causal over n == L. SDPA has no cap, so this is plain torch on every device."""
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale
    scores = torch.tanh(scores / cap) * cap
    if mask is None:
        n = q.shape[2]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)


# A chunk after at least this many cached keys attends in two flash passes (cached_then_causal_attention):
# faster, but its sums round differently from the one masked pass. Below it the masked pass stays, whose
# logits equal a whole-prompt prefill's to the bit, so a short prefix-cache hit changes no logit (tested).
SPLIT_ATTENTION_MIN_CACHED = 1024


class PagedAttention:
    """Stateless attention backend; the KV pool tensors are passed in per layer. `scale`: the softmax scale
    (None: head_dim ** -0.5); `softcap`: Gemma 2's cap on the scores."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                 use_kernel: bool | None = None, scale: float | None = None, softcap: float | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap  # the C++ kernels cap decode scores themselves; prefill chunks cap in torch
        kernels = load_cpu_kernels() if device.type == "cpu" and use_kernel is not False else None
        self._decode_kernel = kernels.paged_decode_attention if kernels is not None else None
        self._write_kv = getattr(kernels, "write_kv", None)
        self._fused_decode = getattr(kernels, "fused_decode_attention", None)
        self._prefill_kernel = prefill_kernel(kernels) if head_dim % 32 == 0 else None

    @property
    def uses_kernel(self) -> bool:
        return self._decode_kernel is not None

    def fused_decode(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     window: int | None = None) -> torch.Tensor | None:
        """A decode-only step's whole attention in one C++ call: RoPE on the fused projection qkv
        [T, (H + 2 KVH) D] in place (cos, sin: the rotary tables), the new K/V into the pool, paged
        attention; returns [T, H D]. None where it does not apply (a prefill in the step, no kernels):
        then the caller rotates and calls `forward`."""
        if (self._fused_decode is None or meta.prefills or not qkv.is_contiguous() or cos.dtype != qkv.dtype
                or meta.num_decode_tokens != qkv.shape[0]):
            return None
        return self._fused_decode(qkv, self.num_heads, self.num_kv_heads, self.head_dim, positions, cos, sin,
                                  k_cache, v_cache, meta.slot_mapping, meta.decode_block_tables,
                                  meta.decode_context_lens, meta.block_size, window or 0, self.scale,
                                  self.softcap or 0.0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, window: int | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_slots, KVH, D] (INT8: [num_slots, KVH, D + 2],
        ops/kv_int8.py); `window`: the layer's sliding window, if it has one. Returns [T, H, D]."""
        if (self._write_kv is not None and k.stride(2) == 1 and v.stride(2) == 1
                and k_cache.dtype in (k.dtype, torch.int8)):
            self._write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            k_cache.index_copy_(0, meta.slot_mapping, stored(k, k_cache.dtype))
            v_cache.index_copy_(0, meta.slot_mapping, stored(v, v_cache.dtype))
        parts = []
        num_decode = meta.num_decode_tokens
        if num_decode:
            q_decode = q[:num_decode]
            if self._decode_kernel is not None:
                parts.append(self._decode_kernel(q_decode, k_cache, v_cache, meta.decode_block_tables,
                                                 meta.decode_context_lens, meta.block_size, window or 0,
                                                 self.scale, self.softcap or 0.0))
            else:
                gather = meta.decode_gathers.get(window)
                if gather is None:
                    max_len = meta.decode_max_len or int(meta.decode_context_lens.max())
                    gather = meta.decode_gathers[window] = decode_gather(
                        meta.decode_block_tables, meta.decode_context_lens, meta.block_size, max_len, window)
                parts.append(gathered_decode_attention(q_decode, k_cache, v_cache, gather, self.scale, self.softcap))
        for span in meta.prefills:
            parts.append(self._prefill(q, k, v, k_cache, v_cache, meta, span, window))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, span: PrefillSpan,
                 window: int | None) -> torch.Tensor:
        end = span.start + span.num_tokens
        if (self._prefill_kernel is not None and self.softcap is None and q.dtype == torch.bfloat16
                and k_cache.dtype == torch.bfloat16):
            slots = meta.slot_mapping[span.start:end] if span.context_slots is None else span.context_slots
            return self._prefill_kernel(q[span.start:end], k_cache, v_cache, slots, window or 0, self.scale)
        q_span = q[span.start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if span.context_slots is None and k_cache.dtype == k.dtype:  # the chunk is the whole context
            keys = k[span.start:end].transpose(0, 1).unsqueeze(0)
            values = v[span.start:end].transpose(0, 1).unsqueeze(0)
        else:  # read from the pool: earlier chunks are cached, and a quantized cache's keys are read as every later
            # chunk and decode step reads them (its rows widened: this chunk's context only)
            slots = meta.slot_mapping[span.start:end] if span.context_slots is None else span.context_slots
            keys = loaded(k_cache[slots], q.dtype).transpose(0, 1).unsqueeze(0)
            values = loaded(v_cache[slots], q.dtype).transpose(0, 1).unsqueeze(0)
        offset = span.context_len - span.num_tokens
        plain_causal = offset == 0 and (window is None or window >= span.num_tokens)
        if self.softcap is not None:
            mask = None if plain_causal else _chunk_mask(span, offset, window, q.device)
            out = softcapped_attention(q_span, keys, values, mask, self.scale, self.softcap)
        elif plain_causal:
            out = F.scaled_dot_product_attention(q_span, keys, values, is_causal=True, scale=self.scale,
                                                 enable_gqa=True)
        elif (q.device.type == "cpu" and offset >= SPLIT_ATTENTION_MIN_CACHED
              and (window is None or window >= span.context_len)):
            out = cached_then_causal_attention(q_span, keys, values, offset, self.scale)
        else:
            out = F.scaled_dot_product_attention(q_span, keys, values, attn_mask=_chunk_mask(span, offset, window,
                                                 q.device), scale=self.scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)


def prefill_kernel(kernels) -> Callable | None:
    """csrc/prefill_attention.cpp's bfloat16 prefill attention where it is the faster one: on AVX512-BF16
    without AMX. There torch's flash kernel ran at ~140 GFLOP/s and this one at ~330 (an 8k prompt's 16
    layers at the 1B shape on a 2-core Zen 4: 31 s -> 13 s of attention); on an AMX CPU torch's kernel
    computes on the tiles (oneDNN brgemm), which this one does not use."""
    if kernels is None or not getattr(kernels, "prefill_attention_available", lambda: False)():
        return None
    if "amx_bf16" in cpu_features():
        return None
    return kernels.prefill_attention


def cached_then_causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, offset: int,
                                 scale: float) -> torch.Tensor:
    """A chunk of n queries after `offset` cached keys: each sees every cached key, and the chunk's own
    keys causally. q: [1, H, n, D]; keys, values: [1, KVH, offset + n, D] (heads grouped as GQA).

    Two passes of torch's CPU flash kernel, the cached keys unmasked and the chunk's own causal, merged by
    their log-sum-exp. One pass with an [n, L] mask computes and masks every key block; this skips the
    masked ones and the mask: the last 2,048-token chunk of an 8k prompt at the 1B shape, 1.14 -> 0.88 s
    of attention a layer on Zen 3."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    cached, cached_lse = flash(q, keys[:, :, :offset], values[:, :, :offset], 0.0, False, scale=scale)
    own, own_lse = flash(q, keys[:, :, offset:], values[:, :, offset:], 0.0, True, scale=scale)
    top = torch.maximum(cached_lse, own_lse)
    cached_weight = (cached_lse - top).exp().unsqueeze(-1)
    own_weight = (own_lse - top).exp().unsqueeze(-1)
    merged = (cached.float() * cached_weight + own.float() * own_weight) / (cached_weight + own_weight)
    return merged.to(q.dtype)


def _chunk_mask(span: PrefillSpan, offset: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Query i sits at offset + i: it sees the keys up to there (and within the window). [n, L]"""
    rows = torch.arange(span.num_tokens, device=device)[:, None] + offset
    columns = torch.arange(span.context_len, device=device)[None, :]
    mask = columns <= rows
    if window is not None:
        mask &= columns > rows - window
    return mask
