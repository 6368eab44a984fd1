"""A compiled call's roofline: its bytes, flops and op count (XLA's cost analysis, corrected for
gathers) turned into a predicted time per device from datasheet figures. An estimate, not a
simulation (``predict``)."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np

__all__ = ["DEVICES", "gather_overcount", "predict", "roofline"]

# datasheet figures: HBM bytes/s, dense peak flop/s (bfloat16; float32 matmuls at XLA's default precision run
# as TF32 on H100/H200 (half the bf16 rate) and as bf16 passes on TPU), and the launch cost assumed per compiled op
DEVICES: dict[str, dict[str, float]] = {
    "H100 SXM": {"bytes_per_s": 3.35e12, "bf16_flops": 989e12, "f32_flops": 494e12, "launch_s": 4e-6},
    "H200": {"bytes_per_s": 4.8e12, "bf16_flops": 989e12, "f32_flops": 494e12, "launch_s": 4e-6},
    "TPU v5e": {"bytes_per_s": 8.19e11, "bf16_flops": 197e12, "f32_flops": 197e12 / 3, "launch_s": 1e-6},
    "TPU v6e": {"bytes_per_s": 1.64e12, "bf16_flops": 918e12, "f32_flops": 918e12 / 3, "launch_s": 1e-6},
}


def roofline(compiled, dtype) -> dict:
    """Bytes, flops and op count of one compiled call, and the step time they predict per device."""
    from specjax.hlo_ops import count_ops

    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list | tuple) else ca
    raw, flops = float(ca.get("bytes accessed", 0.0)), float(ca.get("flops", 0.0))
    text = compiled.as_text()
    over = gather_overcount(text)
    nbytes = max(raw - over, 0.0)
    ops = sum(count_ops(text).values())
    return {"bytes": nbytes, "bytes_xla": raw, "gather_overcount": over, "flops": flops, "ops": ops,
            "predicted_ms": predict(nbytes, flops, ops, dtype)}


_DEF = re.compile(r"%([\w.\-]+) = (\w+)\[([\d,]*)\]")  # an instruction: its name, element type and shape
_GATHER = re.compile(r"%[\w.\-]+ = (\w+)\[([\d,]*)\]\S* gather\(%([\w.\-]+)")
_ITEM = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}


def gather_overcount(hlo_text: str) -> float:
    """Bytes XLA's cost analysis counts for gathers beyond what they read: it charges a gather its
    whole operand (a token lookup in a 151,936 x 1,024 float32 embedding: 622 MB), while a gather
    reads what it returns. The sum over every gather of (operand bytes - output bytes)."""
    shapes = {m.group(1): (m.group(2), m.group(3)) for m in _DEF.finditer(hlo_text)}
    size = lambda t, s: _ITEM.get(t, 4) * float(np.prod([int(x) for x in s.split(",") if x]))  # noqa: E731
    total = 0.0
    for m in _GATHER.finditer(hlo_text):
        out_t, out_s, operand = m.groups()
        if operand in shapes:
            total += max(size(*shapes[operand]) - size(out_t, out_s), 0.0)
    return total


def predict(nbytes: float, flops: float, ops: int, dtype) -> dict[str, dict[str, float]]:
    """Predicted ms of a call per device in ``DEVICES``: ``bound_ms``, the slower of reading
    ``nbytes`` at HBM bandwidth and ``flops`` at peak, and ``launch_ms``, ``ops`` launches at the
    stated cost; ``ms`` their sum. An estimate, not a simulation: every op is assumed to stream
    at full bandwidth, and the op count is XLA:CPU's (a GPU or TPU compile fuses more: the launch
    term is an upper bound there, and CUDA graphs cut it further)."""
    key = "bf16_flops" if jnp.dtype(dtype).itemsize == 2 else "f32_flops"
    out = {}
    for name, d in DEVICES.items():
        bound, launch = 1e3 * max(nbytes / d["bytes_per_s"], flops / d[key]), 1e3 * ops * d["launch_s"]
        out[name] = {"ms": bound + launch, "bound_ms": bound, "launch_ms": launch}
    return out
