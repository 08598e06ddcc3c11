"""RoPE frequencies with a checkpoint's context-extension scaling, computed in float32 as transformers computes them.

`rope_frequencies(head_dim, theta, scaling, max_position)` returns the inverse frequencies [head_dim / 2] and the
factor the cos/sin tables are multiplied by (YaRN's and LongRoPE's attention factor; 1.0 for every other kind).
"""

from __future__ import annotations

import math
from typing import Any

import torch

ROPE_SCALING_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int
) -> tuple[torch.Tensor, float]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    kind = "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0  # type: ignore[index]
    if kind == "dynamic":
        # Dynamic NTK raises the base only for contexts past max_position_embeddings; positions are capped there
        # (config.max_position), so within what is served the frequencies are the plain ones, as in transformers.
        return inv_freq, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0  # type: ignore[arg-type]
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, max_position)  # type: ignore[arg-type]
    if kind == "longrope":
        return _longrope(head_dim, theta, scaling, max_position)  # type: ignore[arg-type]
    raise ValueError(f"unsupported rope scaling {kind!r} (supported: {', '.join(ROPE_SCALING_TYPES)})")


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_dim: int, theta: float, scaling: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): interpolate the low frequencies, extrapolate the high ones, ramp between them by
    rotations over the original context; cos/sin are scaled by the attention factor (eq. 21)."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return interpolated * (1 - keep) + extrapolated * keep, float(attention_factor)


def _longrope(head_dim: int, theta: float, scaling: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (arXiv 2402.13753; Phi-3, Phi-3.5, Phi-4-mini): each frequency divided by its own factor, from the
    `long_factor` list when the served context exceeds the original one, else `short_factor`; cos/sin scaled by
    sqrt(1 + ln(factor) / ln(original context)).

    The set is chosen once for the model from its context length, not per step from the longest sequence in the batch
    as transformers does: a key's rotation then never changes after its KV entry is written, and a request's output
    does not depend on what it is batched with. Up to the original context this equals transformers exactly."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    chosen = scaling["long_factor"] if max_position > original else scaling["short_factor"]
    if len(chosen) != head_dim // 2:
        raise ValueError(f"longrope: {len(chosen)} rescale factors for head_dim {head_dim} (need {head_dim // 2})")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(chosen, dtype=torch.float32) * theta**exponents), float(attention_factor)
