"""One process of the two-process test (``test_sharding.py``): run by ``python -m`` with
``PROCESS_ID`` and ``COORDINATOR`` set; prints one JSON line with this process's result.

Each process holds two CPU devices and its own prompts; the mesh spans both processes. Its
rows must come back equal to a single-process run of the same prompts."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from compile_flags import with_cheap_compiles  # noqa: E402

os.environ["XLA_FLAGS"] = with_cheap_compiles("--xla_force_host_platform_device_count=2")

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(os.environ["COORDINATOR"], num_processes=2, process_id=int(os.environ["PROCESS_ID"]))

import numpy as np  # noqa: E402

import specjax  # noqa: E402
from specjax.model import ModelConfig, init_model  # noqa: E402

pid = jax.process_index()
cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, d_ff=64, max_seq_len=128)
model = init_model(cfg, seed=3)
rng = np.random.default_rng(10 + pid)  # each process its own prompts (of its own lengths)
prompts = [rng.integers(1, 64, size=int(n)).tolist() for n in rng.integers(2, 12 + 6 * pid, size=4)]
kw = dict(max_new_tokens=8 + 4 * pid, drafter="mtp", depth=2, cache=os.environ.get("CACHE", "dense"))
out = {"process": pid, "devices": jax.device_count(), "local_devices": jax.local_device_count()}
for data, mdl in ((2, 2), (4, 1)):
    got = specjax.generate(model, prompts, mesh=specjax.make_mesh(data, mdl), **kw)
    out[f"{data}x{mdl}"] = got.tokens
out["alone"] = specjax.generate(model, prompts, **kw).tokens
print("RESULT " + json.dumps(out), flush=True)
jax.distributed.shutdown()
