"""Compile a generation for a TPU slice from any machine: ``specjax compile``.

libtpu's compile-only client (``pip install -e '.[tpu]'``) builds a TPU topology with no chip
present; XLA:TPU and Mosaic then compile the prefill and the decode step for real, from
abstract shapes only (no weights are read or made). What the compiler says is reported:

* whether each program compiles, and in how long;
* per-chip HBM from its memory analysis (arguments, outputs, temporaries) against the chip's
  capacity: "fits", or "needs X GB, the chip has Y" (from the compiler's own out-of-memory
  error when it refuses);
* the largest temporaries and every cache-sized copy or transpose (a relayout of the K/V
  cache each step reads and writes the whole cache again);
* the Mosaic kernels per program (one per attention layer with ``attention="pallas"``).

XLA:TPU's cost analysis is not reported: it does not cost the Pallas kernels.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import fail

__all__ = ["CHIPS", "INSTALL", "HloFacts", "compile_generation", "has_libtpu", "hlo_facts", "tpu_devices"]

# HBM per chip in GiB (public specs); the compiler's own figure, when it refuses, wins
CHIPS = {"v5e": 16, "v5p": 95, "v6e": 32, "v4": 32}
_ACCELERATOR = {"v5e": "v5litepod-4", "v5p": "v5p-8", "v6e": "v6e-4", "v4": "v4-8"}
INSTALL = "libtpu is not installed: pip install -e '.[tpu]' (compiles for TPU on any machine; no TPU needed)"
GIB = 1 << 30
PROGRAMS = ("prefill", "decode_step")


def has_libtpu() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def tpu_devices(chip: str, topology: str) -> list:
    """The devices of a compile-only ``chip`` slice of ``topology`` chips (``AxB``; v5p and v4
    take ``AxBxC``, ``AxB`` meaning ``AxBx1``). A slice smaller than one host (2x2) is refused
    by libtpu; compile on one of its chips instead (``--mesh 1x1``)."""
    if chip not in CHIPS:
        fail("chip", chip, f"one of {list(CHIPS)}")
    if not re.fullmatch(r"\d+x\d+(x\d+)?", topology):
        fail("topology", topology, "chips per axis, AxB (e.g. 2x2)")
    if not has_libtpu():
        raise RuntimeError(INSTALL)
    # libtpu reads the TPU VM's metadata at load: on any other machine it would warn about each
    # missing variable (a real TPU VM's own values win); a second process needs the lock off
    for var, value in (("TPU_ACCELERATOR_TYPE", _ACCELERATOR[chip]), ("TPU_WORKER_HOSTNAMES", "localhost"),
                       ("TPU_SKIP_MDS_QUERY", "1"), ("TF_CPP_MIN_LOG_LEVEL", "3"),
                       ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
        os.environ.setdefault(var, value)
    from jax.experimental import topologies

    name = topology if chip not in ("v5p", "v4") or topology.count("x") == 2 else f"{topology}x1"
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=f"{chip}:{name}").devices)
    except Exception as e:  # libtpu's own words: an unknown chip, a slice below one host
        raise ValueError(f"topology={chip}:{name} is invalid: {str(e).splitlines()[0]}") from None


@dataclasses.dataclass(frozen=True)
class HloFacts:
    """What the optimized HLO of one program shows."""

    mosaic_calls: int  # Pallas TPU kernels (tpu_custom_call)
    big_copies: list[str]  # copies / transposes of at least ``threshold`` bytes: "op dtype[shape]"
    largest: list[tuple[str, int]]  # the largest arrays the entry computation makes: (op dtype[shape], bytes)


_ITEM = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s64": 8, "f64": 8}
_INSTR = re.compile(r"^\s*(?:ROOT )?%?(\S+) = (\w+)\[([\d,]*)\]\{?[^ ]* (\w[\w-]*)\(")
# a fusion XLA names for a copy or transpose it wraps (``copy_bitcast_fusion``, ``transpose_fusion``...):
# a relayout all the same
_COPY_FUSION = re.compile(r"^(?:copy|transpose|bitcast_copy)[\w-]*fusion")


def _bytes(dtype: str, dims: str) -> int:
    return int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * _ITEM.get(dtype, 4)


def _materialized(text: str):
    """The instruction lines of ``text`` whose results live in memory: every computation but the
    bodies of fusions (their values stay in registers and VMEM) and scalar reducers."""
    inside = False
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            inside = not re.search(r"fused|fusion|region|wrapped|reducer|add\.|max\.|min\.", line.split("(")[0])
            continue
        if line.startswith("}"):
            inside = False
            continue
        if inside:
            yield line


def hlo_facts(text: str, threshold: int, top: int = 5) -> HloFacts:
    """Mosaic calls, copies of ``threshold`` bytes or more, and the ``top`` largest arrays made
    (parameters excluded) in the optimized HLO ``text`` of one compiled program."""
    mosaic = text.count('custom_call_target="tpu_custom_call"')
    copies, made = [], []
    for line in _materialized(text):
        m = _INSTR.match(line)
        if not m:
            continue
        name, dtype, dims, op = m.groups()
        size = _bytes(dtype, dims)
        if op in ("parameter", "get-tuple-element", "bitcast", "tuple", "constant"):
            continue
        made.append((f"{op} {dtype}[{dims}]", size))
        if (op in ("copy", "copy-start", "transpose") or (op == "fusion" and _COPY_FUSION.match(name))) \
                and size >= threshold:
            copies.append(f"{name if op == 'fusion' else op} {dtype}[{dims}]")
    made.sort(key=lambda x: -x[1])
    seen, largest = set(), []
    for name, size in made:
        if name not in seen:
            seen.add(name)
            largest.append((name, size))
        if len(largest) == top:
            break
    return HloFacts(mosaic, copies, largest)


# the compiler's two ways of saying a program does not fit ("needs", "has")
_OOM = (re.compile(r"Used ([\d.]+)([KMGT]) of ([\d.]+)([KMGT]) hbm"),
        re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)"))
_UNIT = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _compile(fn, args, threshold: int | None, donate: tuple[int, ...] = (), dump: str | None = None) -> dict:
    """Lower and compile ``fn(*args)`` (``donate``: arguments updated in place, as a generation
    loop carries its state): the memory figures and HLO facts, or the compiler's refusal."""
    t0 = time.perf_counter()
    try:
        compiled = jax.jit(fn, keep_unused=True, donate_argnums=donate).lower(*args).compile()
    except jax.errors.JaxRuntimeError as e:  # the compiler refused: out of HBM ("Used X of Y hbm"), of VMEM, ...
        msg = str(e)
        out = {"compiled": False, "seconds": round(time.perf_counter() - t0, 1),
               "error": " ".join(msg.split("\n")[:2])[:400]}
        m = next((m for m in (p.search(msg) for p in _OOM) if m), None)
        if m is not None:
            out |= {"needs_bytes": int(float(m.group(1)) * _UNIT[m.group(2)]),
                    "hbm_bytes": int(float(m.group(3)) * _UNIT[m.group(4)])}
        return out
    seconds = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    text = compiled.as_text()
    if dump is not None:
        with open(dump, "w") as f:
            f.write(text)
    facts = hlo_facts(text, 1 << 62 if threshold is None else threshold)
    total = ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes - ma.alias_size_in_bytes
    return {"compiled": True, "seconds": round(seconds, 1), "argument_bytes": int(ma.argument_size_in_bytes),
            "output_bytes": int(ma.output_size_in_bytes), "alias_bytes": int(ma.alias_size_in_bytes),
            "temp_bytes": int(ma.temp_size_in_bytes), "total_bytes": int(total), "mosaic_calls": facts.mosaic_calls,
            "cache_sized_copies": facts.big_copies,
            "largest_temporaries": [{"array": a, "bytes": b} for a, b in facts.largest]}


def compile_generation(config, *, chip: str = "v5e", topology: str = "2x2", mesh: tuple[int, int] = (1, 1),
                       batch: int = 1, context: int = 2048, prompt: int | None = None, drafter: str | None = None,
                       depth: int | None = None, tree=None, cache: str = "dense", dtype: str = "bfloat16",
                       layer_loop: str | None = None, attention: str = "pallas", dump: str | None = None,
                       programs: tuple[str, ...] = PROGRAMS, block: int = 16, block_layers: int = 1) -> dict:
    """Compile the prefill and the decode step of ``config`` (a ``ModelConfig``) for ``chip``:
    ``batch`` rows of ``context`` tokens (``prompt`` of them the prompt: default half) on a
    ``data x model`` mesh of the slice's chips. Returns the report (``specjax compile --json``);
    ``dump``: a folder to write each program's optimized HLO to; ``programs``: which to compile.
    ``depth``: drafts per step (default 3; the whole block, ``block - 1``, with
    ``drafter="block"``, whose drafter ``with_block_drafter`` attaches where ``config`` has none)."""
    from specjax.engine import decode_step, fresh_prefill
    from specjax.memory import abstract_state, default_sizing_depth, with_block_drafter
    from specjax.sampling import RowSampling
    from specjax.sharding import DATA, MODEL, param_specs, placed_shapes, state_specs

    data, model = mesh
    devices = tpu_devices(chip, topology)
    if not programs or set(programs) - set(PROGRAMS):
        fail("programs", programs, f"some of {list(PROGRAMS)}")
    if data * model > len(devices):
        fail("mesh", f"{data}x{model}", f"at most the slice's {len(devices)} chips ({chip}:{topology})")
    if batch % data:
        fail("batch", batch, f"a multiple of the mesh's data axis ({data})")
    prompt = context // 2 if prompt is None else prompt
    if not 1 <= prompt < context:
        fail("prompt", prompt, f"in [1, context={context})")
    if drafter == "block":
        config = with_block_drafter(config, block, block_layers)
    if drafter is None:
        depth = 0
    elif depth is None:
        depth = default_sizing_depth(config, drafter)
    grid = jax.sharding.Mesh(np.array(devices[: data * model]).reshape(data, model), (DATA, MODEL))
    before = jax.config.jax_default_device, jax.config.jax_enable_compilation_cache
    jax.config.update("jax_default_device", devices[0])  # Mosaic and the engine read the target platform here
    jax.config.update("jax_enable_compilation_cache", False)  # a compile-only client cannot load cached programs
    try:
        eng, params, st = abstract_state(config, data, model, batch, prompt, context - prompt, depth, drafter,
                                          cache, jnp.dtype(dtype), tree=tree, attention_impl=attention,
                                          layer_loop=layer_loop)
        if data * model > 1:
            eng = dataclasses.replace(eng, mesh=grid)
        p_abs = placed_shapes(params, param_specs(params, grid), grid)
        s_abs = placed_shapes(st, state_specs(st, grid), grid)
        one = jax.sharding.NamedSharding(grid, jax.sharding.PartitionSpec())

        def put(shape, dt):
            return jax.ShapeDtypeStruct(shape, dt, sharding=one)

        b = batch
        prefill_args = (put((b, prompt), jnp.int32), put((b,), jnp.int32), put((b,), jnp.int32),
                        put((b, 4), jnp.int32), put((b,), jnp.uint32),
                        RowSampling(put((b,), jnp.float32), put((b,), jnp.int32), put((b,), jnp.float32)))
        kv_layer = _kv_layer_bytes(st, data * model)
        built = {"decode_step": lambda: _compile(lambda p, s: decode_step(eng, p, s), (p_abs, s_abs), kv_layer,
                                                 donate=(1,), dump=_path(dump, "decode_step")),
                 # the prefill makes the caches (no per-token copy to find): activations only
                 "prefill": lambda: _compile(lambda p, *a: fresh_prefill(eng, p, *a), (p_abs, *prefill_args),
                                             None, dump=_path(dump, "prefill"))}
        with jax.set_mesh(grid):
            out = {name: built[name]() for name in programs}
    finally:
        jax.config.update("jax_default_device", before[0])
        jax.config.update("jax_enable_compilation_cache", before[1])
    capacity = CHIPS[chip] * GIB
    return _verdict({"chip": chip, "device_kind": devices[0].device_kind, "topology": topology,
                     "mesh": f"{data}x{model}", "batch": batch, "context": context, "prompt": prompt,
                     "drafter": drafter, "depth": depth, "tree": None if tree is None else str(tree), "cache": cache,
                     "dtype": dtype, "attention": eng.attention_impl, "capacity_slots": eng.capacity,
                     "kv_layer_bytes": kv_layer, "kv_bytes": _kv_bytes(st, data * model), "hbm_bytes": capacity,
                     "programs": list(programs), **out})


def _path(folder: str | None, name: str) -> str | None:
    if folder is None:
        return None
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{name}.hlo.txt")


def _kv_bytes(st, devices: int) -> int:
    """The target's whole K/V per chip."""
    return sum(int(np.prod(x.shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(st.cache) if x.ndim >= 4) // max(devices, 1)


def _kv_layer_bytes(st, devices: int) -> int:
    """One layer's K (or V) per chip: the size a relayout copy of the cache has."""
    leaves = [x for x in jax.tree.leaves(st.cache) if x.ndim >= 4]
    if not leaves:
        return 1 << 62
    one = min(leaves, key=lambda x: -int(np.prod(x.shape)))
    return int(np.prod(one.shape, dtype=np.int64)) * jnp.dtype(one.dtype).itemsize // max(devices, 1)


def _verdict(report: dict) -> dict:
    """``fits`` and its one-line ``verdict``: the larger program's total against the chip's HBM
    (the compiler's own HBM figure where it refused)."""
    parts = {name.replace("_", " "): report[name] for name in report["programs"]}
    hbm = next((p["hbm_bytes"] for p in parts.values() if "hbm_bytes" in p), report["hbm_bytes"])
    need = max(p.get("total_bytes", p.get("needs_bytes", 0)) for p in parts.values())
    broken = [f"the {name} does not compile: {p['error']}" for name, p in parts.items()
              if not p["compiled"] and "needs_bytes" not in p]
    report["fits"] = not broken and need <= hbm
    report["needs_bytes"] = need
    if broken:
        report["verdict"] = broken[0]
    elif report["fits"]:
        report["verdict"] = f"fits: {need / GIB:.2f} GiB of {hbm / GIB:.2f} GiB per chip"
    else:
        report["verdict"] = f"needs {need / GIB:.2f} GiB per chip, the chip has {hbm / GIB:.2f} GiB"
    return report
