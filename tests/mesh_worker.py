"""Eight CPU devices in one process: the mesh checks of ``test_sharding.py`` (run in a
subprocess so the rest of the suite keeps one device). ``python tests/mesh_worker.py DRAFTER``
prints one JSON line: per mesh and setting, whether the tokens equal the unsharded run, and
every parameter and engine-state leaf whose actual sharding differs from what the test
expects (written out here, independently of ``specjax.sharding``'s table)."""

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from compile_flags import with_cheap_compiles  # noqa: E402

os.environ["XLA_FLAGS"] = with_cheap_compiles("--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

# compile time dominates these checks (about 60 small compiles per drafter): XLA's cheaper
# optimisation level cuts it by about 30%; sharded and unsharded runs share it
jax.config.update("jax_disable_most_optimizations", True)
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import specjax  # noqa: E402
from specjax import generation  # noqa: E402
from specjax.generation_config import GenerationConfig  # noqa: E402
from specjax.model import ModelConfig  # noqa: E402
from specjax.sharding import make_mesh, shard_model  # noqa: E402

from engine_models import noisy, sharp  # noqa: E402

# KV heads (2) fewer than the widest model axis (8); sliding-window and global layers
CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=64,
                  tie_embeddings=False, sliding_window=6, global_every=2, mtp_depth=1)
MESHES = ((8, 1), (4, 2), (2, 4), (1, 8))
SETTINGS = [(rule, cache) for rule in ("per_sequence", "cohort") for cache in ("dense", "paged")]

# what every parameter's spec must be (a stacked layer's [L] axis aside)
WANT_PARAM = {"embed": P("model", None), "lm_head": P(None, "model"), "wqkv": P(None, "model"), "wo": P("model", None),
              "w_gate_up": P(None, "model"), "w_down": P("model", None), "proj": P(), "bqkv": P("model"), "fc": P()}


def param_problems(params) -> list[str]:
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = str(path[-1].key)
        want = P() if "norm" in name else WANT_PARAM[name]
        want = [None] * (x.ndim - len(want)) + list(want)  # a stacked layer's [L] axis: whole
        mesh = x.sharding.mesh  # an axis that does not divide (a vocabulary of 259) stays whole
        want = P(*[a if a is None or x.shape[i] % mesh.shape[a] == 0 else None for i, a in enumerate(want)])
        if not x.sharding.is_equivalent_to(NamedSharding(x.sharding.mesh, want), x.ndim):
            out.append(f"{jax.tree_util.keystr(path)} {x.sharding.spec} != {want}")
    return out


def state_problems(st, batch: int) -> list[str]:
    """Every per-row leaf ([B, ...]) split over "data" on its first axis, every KV buffer's
    heads over "model" and its rows (the paged pool: its pages, one pool per data shard) over
    "data", the paged free stacks and counts over "data", the step counter replicated."""
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(st)[0]:
        key = jax.tree_util.keystr(path)
        if key.endswith((".k", ".v")) or ".k[" in key or ".v[" in key:
            want = (None,) * (x.ndim - 4) + ("data", "model", None, None)  # stacked layers: [L] whole
        elif key.endswith(("free_pages", "num_free", "refs", "cached")):
            want = ("data",)
        elif ".auto" in key or key == ".i":
            want = (None,) * x.ndim
        elif x.ndim and x.shape[0] == batch:
            want = ("data",) + (None,) * (x.ndim - 1)
        else:
            out.append(f"{key}: unexpected leaf {x.shape}")
            continue
        if not x.sharding.is_equivalent_to(NamedSharding(x.sharding.mesh, P(*want)), x.ndim):
            out.append(f"{key} {x.sharding.spec} != {want}")
    return out


DRAFTERS = ("mtp", "ngram", "draft_model")


def cover(drafter: str) -> list[tuple[tuple[int, int], str, str]]:
    """Four runs for ``drafter``: every mesh once and every (rule, cache) once, rotated per
    drafter so that each mesh meets every drafter too (what the default suite runs; ``all all``
    is the full product, 16 runs)."""
    k = DRAFTERS.index(drafter)
    return [(MESHES[(i + k) % len(MESHES)], *SETTINGS[i]) for i in range(len(SETTINGS))]


def main(drafter: str, runs, pallas: bool = False) -> None:
    """``runs``: ``(mesh, rule, cache)`` triples, each compared with the unsharded run."""
    target = sharp(CFG, seed=1)
    draft = noisy(target, 0.5) if drafter == "draft_model" else None
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 64, size=int(n)).tolist() for n in (5, 9, 3, 7, 4, 6, 8, 2)]
    result = {"tokens": {}, "params": {}, "state": {}}
    refs = {}
    for (d, m), rule, cache in runs:
        kw = dict(max_new_tokens=8, drafter=drafter, draft_model=draft, depth=2, kv_advance=rule, cache=cache)
        if (rule, cache) not in refs:
            refs[rule, cache] = specjax.generate(target, prompts, **kw).tokens
        mesh = make_mesh(d, m)
        name = f"{d}x{m} {rule} {cache}"
        sm = shard_model(target, mesh)
        skw = dict(kw, draft_model=None if draft is None else shard_model(draft, mesh))
        with jax.transfer_guard("disallow"):  # no implicit transfer anywhere in a sharded generate
            got = specjax.generate(sm, prompts, mesh=mesh, **skw).tokens
        result["tokens"][name] = got == refs[rule, cache]
        result["params"][f"{d}x{m}"] = param_problems(sm.params)
        cfg = GenerationConfig(max_new_tokens=8, drafter=drafter, depth=2, kv_advance=rule, cache=cache,
                               attention_impl="xla")
        eng, params, args = generation.setup(sm, prompts, cfg, skw["draft_model"], mesh)
        limit = generation.put_rows_of(np.int32(eng.max_steps), mesh)
        run, _ = generation.compiled_loop(eng, params, (*args, None, limit))  # cached
        st = run(params, *args, None, limit)
        result["state"][name] = state_problems(st, len(prompts))
    if pallas:  # the Pallas kernels per shard (shard_map), interpret mode on CPU: one mesh, the paged kernel
        for cache in ("paged",):
            kw = dict(max_new_tokens=8, drafter=drafter, draft_model=draft, depth=2, cache=cache,
                      attention_impl="pallas")
            ref = specjax.generate(target, prompts, **kw).tokens
            mesh = make_mesh(2, 4)
            sm = shard_model(target, mesh)
            skw = dict(kw, draft_model=None if draft is None else shard_model(draft, mesh))
            result["tokens"][f"2x4 pallas {cache}"] = specjax.generate(sm, prompts, mesh=mesh, **skw).tokens == ref
    print("RESULT " + json.dumps(result), flush=True)


# token trees on a mesh: (drafter, tree, depth, mesh, rule, cache, attention_impl)
TREE_RUNS = (("draft_model", "dynamic:4,2", 2, (4, 2), "per_sequence", "paged", "xla"),
             ("ngram", "dynamic:4,2", 2, (2, 4), "cohort", "dense", "xla"),
             ("mtp", (2, 1), 2, (8, 1), "per_sequence", "dense", "xla"),
             ("mtp", "dynamic:4,2", 2, (2, 4), "per_sequence", "paged", "pallas"))


def trees() -> None:
    """Token trees on a mesh: every drafter's tree, both rules, dense and paged caches, the
    Pallas kernel per shard: the unsharded tokens, the state placed by the table (the tree's
    per-row counters too); a batch job with a tree; a tree under ``depth="auto"``."""
    target = sharp(CFG, seed=1)
    draft = noisy(target, 0.5)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 64, size=int(n)).tolist() for n in (5, 9, 3, 7, 4, 6, 8, 2)]
    prompts[2] = [7, 8, 9] * 3  # repetitive rows: n-gram trees with several continuations
    result = {"tokens": {}, "params": {}, "state": {}, "accepted": {}}
    for drafter, tree, depth, (d, m), rule, cache, impl in TREE_RUNS:
        kw = dict(max_new_tokens=10, drafter=drafter, depth=depth, tree=tree, kv_advance=rule, cache=cache,
                  attention_impl=impl)
        ref = specjax.generate(target, prompts, draft_model=draft, **kw).tokens
        mesh = make_mesh(d, m)
        sm, sd = shard_model(target, mesh), shard_model(draft, mesh)
        name = f"{drafter} {tree} {d}x{m} {rule} {cache} {impl}"
        with jax.transfer_guard("disallow"):
            out = specjax.generate(sm, prompts, mesh=mesh, draft_model=sd, **kw)
        result["tokens"][name] = out.tokens == ref
        result["accepted"][name] = out.metrics["accepted_drafts"]
        cfg = GenerationConfig(**kw)
        eng, params, args = generation.setup(sm, prompts, cfg, sd if drafter == "draft_model" else None, mesh)
        limit = generation.put_rows_of(np.int32(eng.max_steps), mesh)
        run, _ = generation.compiled_loop(eng, params, (*args, None, limit))
        result["state"][name] = state_problems(run(params, *args, None, limit), len(prompts))
    result["forward"] = tree_forward_gap(target)
    mesh = make_mesh(4, 2)
    reqs = [{"prompt": p, "max_new_tokens": 8} for p in prompts]
    kw = dict(drafter="draft_model", depth=2, tree="dynamic:4,2", cache="paged")
    ref = {c.id: c.tokens for c in specjax.batch_generate(target, reqs, slots=4, draft_model=draft, **kw)}
    got = {c.id: c.tokens for c in specjax.batch_generate(shard_model(target, mesh), reqs, slots=4, mesh=mesh,
                                                          draft_model=shard_model(draft, mesh), **kw)}
    result["tokens"]["batch_generate paged tree"] = got == ref
    kw = dict(max_new_tokens=10, drafter="draft_model", depth="auto", max_depth=2, tree="dynamic:4,2")
    ref = specjax.generate(target, prompts, draft_model=draft, **kw).tokens
    got = specjax.generate(shard_model(target, mesh), prompts, mesh=mesh, draft_model=shard_model(draft, mesh), **kw)
    result["tokens"]["auto tree"] = got.tokens == ref
    print("RESULT " + json.dumps(result), flush=True)


def tree_forward_gap(target) -> dict:
    """One tree forward (8 rows of their own lengths and random trees, sliding-window and
    global layers) on meshes 2x4 and 8x1 against one device: the largest hidden difference.
    Tokens alone could hide a mask lost per shard (a sharp model's argmax barely reads it)."""
    import jax.numpy as jnp

    from specjax.model import forward_hidden, init_cache
    from specjax.tree import TreeMask, ancestors, depths

    cfg, b, n, width = target.config, 8, 6, 12
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, cfg.vocab_size, (b, width)).astype(np.int32)
    lengths = rng.integers(1, width + 1, b).astype(np.int32)
    parents = np.stack([[-1] + [int(rng.integers(0, j)) for j in range(1, n)] for _ in range(b)]).astype(np.int32)
    tokens = rng.integers(0, cfg.vocab_size, (b, n)).astype(np.int32)
    tpos = lengths[:, None] + np.asarray(depths(parents))
    mask = TreeMask(lengths, np.asarray(ancestors(parents)), tpos, tpos)

    def run(model, prompt, lengths, tokens, tpos, mask):  # prefill rows of their own lengths, then the tree
        c = init_cache(model.config, b, 32, kind="dense", slack=16)
        pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (b, width))
        _, c = forward_hidden(model.params, model.config, prompt, pos, c)
        c = c.advance(width).rollback(lengths)
        return forward_hidden(model.params, model.config, tokens, tpos, c, tree=mask)[0]

    args = (prompt, lengths, tokens, tpos, mask)
    want = np.asarray(jax.jit(run)(target, *args))
    out = {}
    for d, m in ((2, 4), (8, 1)):
        mesh = make_mesh(d, m)
        with jax.set_mesh(mesh):
            got = jax.jit(run)(shard_model(target, mesh), *jax.device_put(args, NamedSharding(mesh, P("data"))))
        out[f"{d}x{m}"] = float(np.max(np.abs(np.asarray(got) - want)))
    return out


def extras() -> None:
    """``load_model(mesh=)`` (orbax into shardings) and ``load_hf_checkpoint(mesh=)`` (tensor by
    tensor): the same tokens as the unsharded loads, every weight where the table puts it;
    ``stream`` and ``batch_generate`` on a mesh; ``specjax.memory`` against XLA; bad settings."""
    from specjax.hf import load_hf_checkpoint

    result = {"tokens": {}, "params": {}, "state": {}}
    mesh = make_mesh(2, 4)
    path = os.path.join(os.path.dirname(__file__), "fixtures", "hf", "gemma3")  # KV heads 2 < 4, sliding layers
    prompts = [[2, 17, 33, 5], [2, 9], [2, 40, 41, 42, 43, 44], [2, 3]]
    kw = dict(max_new_tokens=8, drafter="ngram", depth=2)
    ref = specjax.generate(load_hf_checkpoint(path), prompts, **kw).tokens
    hf = load_hf_checkpoint(path, mesh=mesh)
    result["params"]["hf"] = param_problems(hf.params)
    result["tokens"]["hf"] = specjax.generate(hf, prompts, mesh=mesh, **kw).tokens == ref
    mesh = make_mesh(4, 2)  # the bundled model has 2 query heads
    bundle = specjax.load_model(mesh=mesh)
    result["params"]["bundle"] = param_problems(bundle.model.params)
    texts = ["def f(x):", "import os", "class A:", "for i in"]
    result["tokens"]["bundle"] = bundle.generate(texts, max_new_tokens=8, mesh=mesh)[0] == \
        specjax.load_model().generate(texts, max_new_tokens=8)[0]

    # stream and batch_generate on a mesh: the unsharded tokens
    target = sharp(CFG, seed=1)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    ref = specjax.generate(target, prompts, max_new_tokens=6, depth=2).tokens
    chunks = list(specjax.stream(target, prompts, max_new_tokens=6, depth=2, mesh=mesh))
    result["tokens"]["stream"] = chunks[-1].result.tokens == ref
    reqs = [{"prompt": p, "max_new_tokens": 6} for p in prompts * 3]
    for cache in ("dense", "paged"):
        done = list(specjax.batch_generate(target, reqs, slots=4, depth=2, cache=cache, mesh=mesh))
        got = {c.id: c.tokens for c in done}
        result["tokens"][f"batch_generate {cache}"] = [got[i] for i in range(len(reqs))] == ref * 3
        result["tokens"][f"batch_generate {cache}: latency of every step"] = all(
            len(c.metrics["itl_s"]) == c.metrics["steps"] and 0 <= c.metrics["queue_s"] <= c.metrics["ttft_s"]
            for c in done)
    # one pool per data shard, each of one page (pages=4 on data=4): 2 slots per shard, one request
    # per shard at a time; every request its unsharded tokens
    got = {c.id: c.tokens for c in specjax.batch_generate(target, reqs, slots=8, depth=2, cache="paged", pages=4,
                                                          mesh=mesh)}
    result["tokens"]["batch_generate paged, a page per shard"] = [got[i] for i in range(len(reqs))] == ref * 3
    # chunked prefill on a mesh (dense; paged: each shard's pool lent to the chunks): unsharded tokens
    for cache in ("dense", "paged"):
        got = {c.id: c.tokens for c in specjax.batch_generate(target, reqs, slots=4, depth=2, cache=cache, mesh=mesh,
                                                              prefill_chunk=2)}
        result["tokens"][f"batch_generate {cache}, chunked prefill"] = [got[i] for i in range(len(reqs))] == ref * 3
    # the prefix cache on a mesh (one map per data shard's pool): requests behind a shared head
    # reuse its page within their shard, and every request gets its unsharded tokens
    flat = sharp(dataclasses.replace(CFG, sliding_window=None), seed=1)  # every layer global: pages to share
    preqs = [{"prompt": list(range(1, 21)) + [21 + i], "max_new_tokens": 5} for i in range(8)]
    pref = specjax.generate(flat, [r["prompt"] for r in preqs], max_new_tokens=5, drafter="ngram", depth=2).tokens
    done = {c.id: c for c in specjax.batch_generate(flat, preqs, slots=4, drafter="ngram", depth=2, cache="paged",
                                                    mesh=mesh)}
    result["tokens"]["batch_generate paged, shared prefixes"] = [done[i].tokens for i in range(8)] == pref
    result["tokens"]["batch_generate paged, shared prefixes reused"] = \
        sum(c.metrics["cached_tokens"] for c in done.values()) == 4 * 16  # each shard's later request
    # the MTP block's store of cached pages, one part per shard's pool (group-local page ids)
    pref = specjax.generate(flat, [r["prompt"] for r in preqs], max_new_tokens=5, drafter="mtp", depth=1).tokens
    done = {c.id: c for c in specjax.batch_generate(flat, preqs, slots=4, drafter="mtp", depth=1, cache="paged",
                                                    mesh=mesh)}
    result["tokens"]["batch_generate paged, shared prefixes, mtp"] = [done[i].tokens for i in range(8)] == pref and \
        sum(c.metrics["cached_tokens"] for c in done.values()) == 4 * 16

    # a draft model the model axis cannot split (4 query heads on 8 devices): replicated, same tokens
    small = sharp(ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=24,
                              max_seq_len=64, tie_embeddings=False), seed=3)
    dkw = dict(max_new_tokens=6, drafter="draft_model", draft_model=small, depth=2)
    wide = make_mesh(1, 8)
    result["tokens"]["replicated draft model"] = specjax.generate(
        shard_model(target, wide), prompts, mesh=wide, **dkw).tokens == specjax.generate(target, prompts, **dkw).tokens

    # sizing: the plan's resident bytes are what XLA allocates for the compiled step's arguments
    from specjax.memory import check_compiled

    for (d, m), drafter, cache in (((4, 2), "mtp", "dense"), ((2, 4), "ngram", "paged"), ((8, 1), "mtp", "paged")):
        got = check_compiled(CFG, make_mesh(d, m), batch=16, context=256, drafter=drafter, cache=cache)
        result["memory"] = result.get("memory", []) + [[got["plan_argument_bytes"], got["xla_argument_bytes"],
                                                         got["plan"]["step_activation"], got["xla_temp_bytes"]]]

    # bad settings: one clear error before compile
    errors = {}
    for name, call in (
        ("rows", lambda: specjax.generate(target, prompts[:3], max_new_tokens=4, mesh=make_mesh(4, 2))),
        ("slots", lambda: list(specjax.batch_generate(target, reqs, slots=6, mesh=make_mesh(4, 2)))),
        ("pages", lambda: list(specjax.batch_generate(target, reqs, slots=8, cache="paged", pages=6,
                                                      mesh=make_mesh(4, 2)))),
        ("heads", lambda: shard_model(target, make_mesh(1, 8).__class__(
            np.asarray(jax.devices()[:3], dtype=object).reshape(1, 3), ("data", "model")))),
    ):
        try:
            call()
            errors[name] = "no error"
        except ValueError as e:
            errors[name] = str(e)
    result["errors"] = errors
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    if sys.argv[1] in ("extras", "trees"):
        {"extras": extras, "trees": trees}[sys.argv[1]]()
        sys.exit(0)
    # python tests/mesh_worker.py DRAFTER cover [pallas]
    # python tests/mesh_worker.py DRAFTER MESH,...|all RULE:CACHE,...|all [pallas]   (the product)
    args = sys.argv[1:] + ["cover", "all"]
    if args[1] == "cover":
        runs = cover(args[0])
    else:
        meshes = MESHES if args[1] == "all" else [tuple(int(x) for x in m.split("x")) for m in args[1].split(",")]
        settings = SETTINGS if args[2] == "all" else [tuple(x.split(":")) for x in args[2].split(",")]
        runs = [(mesh, rule, cache) for rule, cache in settings for mesh in meshes]
    main(args[0], runs, pallas="pallas" in args)
