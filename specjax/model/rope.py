"""Rotary position embeddings, with the frequency scalings long-context checkpoints use.

``rope_frequencies`` turns a base and an optional ``RopeScaling`` into the inverse
frequencies ``[head_dim / 2]`` and the factor cos/sin are multiplied by; both are static
(computed in NumPy at trace time, in float32 as transformers does) and ``rope`` applies
them to per-row positions. Scalings, as in transformers' ``modeling_rope_utils``:

- ``linear``: every frequency divided by ``factor`` (position interpolation).
- ``llama3``: wavelengths longer than ``original_max_position / low_freq_factor`` are
  divided by ``factor``, shorter than ``original_max_position / high_freq_factor`` kept,
  and those between blended by a linear ramp in ``original_max_position / wavelength``.
- ``yarn``: a ramp over dimensions between the correction range of ``beta_fast`` and
  ``beta_slow`` rotations blends interpolated and extrapolated frequencies; cos/sin are
  scaled by ``attention_factor`` (default ``0.1 ln(factor) + 1``, or the ``mscale`` ratio).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["RopeScaling", "rope", "rope_frequencies"]

KINDS = ("linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """One RoPE frequency scaling (hashable: part of the static ``ModelConfig``)."""

    kind: str
    factor: float
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    original_max_position: int | None = None  # llama3, yarn: the pre-training context
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None: from factor (and mscale)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"RopeScaling.kind must be one of {list(KINDS)}, got {self.kind!r}")
        if not isinstance(self.factor, int | float) or self.factor <= 0:
            raise ValueError(f"RopeScaling.factor must be a number > 0, got {self.factor!r}")
        need = {"llama3": ("low_freq_factor", "high_freq_factor", "original_max_position"),
                "yarn": ("original_max_position",)}.get(self.kind, ())
        for name in need:
            v = getattr(self, name)
            if not isinstance(v, int | float) or v <= 0:
                raise ValueError(f"RopeScaling.{name} must be a number > 0 for kind {self.kind!r}, got {v!r}")
        if self.kind == "llama3" and self.low_freq_factor >= self.high_freq_factor:
            raise ValueError(f"RopeScaling: low_freq_factor={self.low_freq_factor} must be below "
                             f"high_freq_factor={self.high_freq_factor}")


def _yarn(dim: int, theta: float, s: RopeScaling) -> tuple[np.ndarray, float]:
    factor, orig = float(s.factor), s.original_max_position
    mscale = lambda scale, m=1.0: 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0  # noqa: E731
    if s.attention_factor is not None:
        attention = float(s.attention_factor)
    elif s.mscale and s.mscale_all_dim:
        attention = mscale(factor, s.mscale) / mscale(factor, s.mscale_all_dim)
    else:
        attention = mscale(factor)
    # the dimension whose wavelength makes `rotations` turns over the original context
    corr = lambda rotations: dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
    low, high = corr(s.beta_fast), corr(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of width zero would divide by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolated = np.float32(1.0) / pos_freqs
    interpolated = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    keep = (np.float32(1) - ramp).astype(np.float32)  # 1: extrapolate (high frequencies), 0: interpolate
    return (interpolated * (1 - keep) + extrapolated * keep).astype(np.float32), attention


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``float32 [head_dim / 2]`` and the cos/sin factor (1.0 unless yarn)."""
    if scaling is not None and scaling.kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    inv = (np.float32(1.0) / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32)
                                                    / np.float32(head_dim)))).astype(np.float32)
    if scaling is None:
        return inv, 1.0
    factor = np.float32(scaling.factor)
    if scaling.kind == "linear":
        return (inv / factor).astype(np.float32), 1.0
    # llama3
    orig = np.float32(scaling.original_max_position)
    low_wavelen = orig / np.float32(scaling.low_freq_factor)
    high_wavelen = orig / np.float32(scaling.high_freq_factor)
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)  # long wavelengths: interpolated
    smooth = (orig / wavelen - np.float32(scaling.low_freq_factor)) / np.float32(
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32), 1.0


def rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> jax.Array:
    """Rotate-half RoPE in float32: ``x [B, t, H, hd]`` at ``positions [B, t]`` (per token,
    per row), cos/sin multiplied by ``scale`` (yarn's attention factor, and for queries the
    ratio of a checkpoint's attention scale to ``hd ** -0.5``)."""
    hd = x.shape[-1]
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B, t, hd/2]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, axis=-1)[:, :, None]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, axis=-1)[:, :, None]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x32 = x.astype(jnp.float32)
    half = hd // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)
