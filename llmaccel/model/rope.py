"""Rotary position embeddings: the inverse frequencies and cos/sin tables of every RoPE scaling HF configs
declare (linear, dynamic NTK, YaRN, Llama 3's, LongRoPE, and GGUF's rope_freqs), in HF transformers' formulas,
and how many positions a scaling lets a model serve.

Dynamic NTK is computed once for the longest sequence its factor allows (vLLM's static form): HF recomputes
it per forward pass from the sequence's own length, so the two agree at that length (tested) and llmaccel's
positions never change meaning as a sequence grows.
"""

from __future__ import annotations

import math

import torch

from llmaccel.config import ROPE_SCALINGS

SUPPORTED = ("default", *ROPE_SCALINGS, "freq_factors")  # freq_factors: a GGUF file's rope_freqs


def scaling_kind(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def original_positions(scaling: dict, max_position_embeddings: int) -> int:
    return int(scaling.get("original_max_position_embeddings") or max_position_embeddings)


def servable_positions(max_position_embeddings: int, scaling: dict | None) -> int:
    """The longest sequence the positions allow: the config's own, or its original length times the factor of a
    scaling that stretches it (linear, dynamic, YaRN), whichever is longer."""
    if scaling_kind(scaling) in ("linear", "dynamic", "yarn") and scaling.get("factor"):
        return max(max_position_embeddings, int(original_positions(scaling, max_position_embeddings)
                                                * float(scaling["factor"])))
    return max_position_embeddings


def _plain(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _yarn(head_dim: int, theta: float, scaling: dict, max_position_embeddings: int) -> torch.Tensor:
    """YaRN's blend of interpolated and extrapolated frequencies (HF's _compute_yarn_parameters)."""
    factor = float(scaling["factor"])
    original = original_positions(scaling, max_position_embeddings)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict | None,
                             max_position_embeddings: int | None = None) -> torch.Tensor:
    """Inverse frequencies of RoPE under the scaling, as HF transformers computes them (`max_position_embeddings`:
    the config's, for the scalings whose original length defaults to it)."""
    kind = scaling_kind(scaling)
    inv_freq = _plain(head_dim, theta)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "dynamic":
        original = original_positions(scaling, max_position_embeddings or 0)
        factor = float(scaling["factor"])
        longest = original * factor  # HF's formula at the longest sequence the factor serves
        base = theta * ((factor * longest / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return _plain(head_dim, base)
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, max_position_embeddings or 0)
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if kind == "freq_factors":  # llama.cpp's rope_freqs tensor (Llama 3's scaling as a GGUF file stores it)
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "longrope":  # the short factors; rope_tables takes the long ones past the original length
        return inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float32)
    raise ValueError(f"unsupported rope scaling {kind!r}; llmaccel supports {', '.join(SUPPORTED[:-1])} and "
                     "GGUF rope_freqs")


def attention_factor(scaling: dict | None, max_position_embeddings: int) -> float:
    """The factor HF multiplies cos and sin by (YaRN's mscale, LongRoPE's), else 1."""
    kind = scaling_kind(scaling)
    if kind == "yarn":
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        factor, mscale, mscale_all_dim = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        return yarn_mscale(factor)
    if kind == "longrope":
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        original = int(scaling["original_max_position_embeddings"])
        ratio = scaling.get("factor") or scaling.get("max_position_embeddings", max_position_embeddings) / original
        return math.sqrt(1 + math.log(ratio) / math.log(original)) if ratio > 1.0 else 1.0
    return 1.0


def turn_keys(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """float32 keys [..., D] rotated for position p (rotate-half layout) turned to position p + delta: RoPE's
    rotations compose, R(p + delta) = R(delta) R(p), under every scaling whose frequencies do not depend on the
    position (not LongRoPE). Any attention factor is already in the keys, so the turn is a pure rotation."""
    angles = delta * inv_freq.double()
    cos, sin = torch.cat((angles.cos(), angles.cos())).float(), torch.cat((angles.sin(), angles.sin())).float()
    half = keys.shape[-1] // 2
    return keys * cos + torch.cat((-keys[..., half:], keys[..., :half]), dim=-1) * sin


def rope_tables(head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                max_position_embeddings: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (cos, sin) [max_positions, head_dim] in HF's rotate-half layout. LongRoPE (Phi-3): positions within
    `original_max_position_embeddings` rotate by the short factors, those past it by the long ones (HF switches
    the new tokens' factors there too), both scaled by the attention factor HF derives."""
    trained = max_position_embeddings or max_positions
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * rope_inverse_frequencies(head_dim, theta, scaling, trained)[None, :]
    if scaling_kind(scaling) == "longrope":
        original = int(scaling["original_max_position_embeddings"])
        inv_long = _plain(head_dim, theta) / torch.tensor(scaling["long_factor"], dtype=torch.float32)
        freqs[original:] = positions[original:, None] * inv_long[None, :]
    factor = attention_factor(scaling, trained)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * factor, emb.sin() * factor
