"""Training the bundled models on CPU/GPU/TPU with optax: target, then its MTP module
(target frozen), then a small draft model.

Every stage is ``state -> state`` under one jitted update. The batch for step ``s`` is
a pure function of ``(seed, s)`` (a per-epoch permutation of fixed windows), so
``--resume`` from a checkpoint at step ``s`` sees exactly the data a straight run would.
Checkpoints are orbax ``CheckpointManager`` steps (written to a temporary directory and
renamed, so a kill leaves the previous step intact).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.corpus import Corpus
from specjax.losses import make_loss, merge_params, mtp_chain_logits, split_params
from specjax.model import Model, ModelConfig, init_model

__all__ = [
    "STAGES",
    "StageConfig",
    "batch_for_step",
    "evaluate",
    "mtp_chain_logits",
    "run_stage",
]

STAGES = ("target", "mtp", "draft")  # the recipe's (``specjax train``)
RUN_STAGES = (*STAGES, "block")  # run_stage's: a block drafter too (``specjax.train_block``)
LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class StageConfig:
    """Optimisation settings of one stage."""

    steps: int
    batch: int = 16
    seq_len: int = 512
    lr: float = 2e-3
    warmup: int = 200
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    eval_every: int = 250
    eval_windows: int = 64
    ckpt_every: int = 250
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "seq_len", "eval_every", "eval_windows", "ckpt_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup must be in [0, steps={self.steps}), got {self.warmup}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


# ----------------------------------------------------------------------------- data


def n_windows(stream: np.ndarray, seq_len: int) -> int:
    return max(0, (stream.size - 1) // seq_len)


def batch_for_step(stream: np.ndarray, seq_len: int, batch: int, step: int, seed: int) -> np.ndarray:
    """Windows ``[batch, seq_len + 1]`` for ``step``: sample ``g = step * batch + i`` is
    window ``perm_e[g % n]`` of epoch ``e = g // n`` (windows start every ``seq_len``)."""
    n = n_windows(stream, seq_len)
    if n < 1:
        raise ValueError(f"training stream of {stream.size} tokens is shorter than seq_len + 1 = {seq_len + 1}")
    out = np.empty((batch, seq_len + 1), np.int32)
    perms: dict[int, np.ndarray] = {}
    for i in range(batch):
        g = step * batch + i
        e = g // n
        if e not in perms:
            perms[e] = np.random.default_rng([seed, e]).permutation(n)
        start = int(perms[e][g % n]) * seq_len
        out[i] = stream[start : start + seq_len + 1]
    return out


def eval_windows(stream: np.ndarray, seq_len: int, count: int | None) -> np.ndarray:
    """``count`` evenly spaced held-out windows ``[count, seq_len + 1]`` (all when None)."""
    n = n_windows(stream, seq_len)
    if n < 1:
        raise ValueError(f"held-out stream of {stream.size} tokens is shorter than seq_len + 1 = {seq_len + 1}")
    idx = np.arange(n) if count is None or count >= n else np.linspace(0, n - 1, count).round().astype(int)
    return np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in idx]).astype(np.int32)


# ----------------------------------------------------------------------------- optimiser


def make_optimizer(sc: StageConfig) -> optax.GradientTransformation:
    sched = optax.warmup_cosine_decay_schedule(0.0, sc.lr, max(sc.warmup, 1), sc.steps, sc.lr * sc.min_lr_ratio)
    decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # noqa: E731 (no decay on norms/biases)
    return optax.chain(
        optax.clip_by_global_norm(sc.clip),
        optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=sc.weight_decay, mask=decay_mask),
    )


def evaluate(
    stage: str, params: dict, config: ModelConfig, windows: np.ndarray, mtp_depth: int = 3, chunk: int = 16,
    bytes_only: bool = True, block_first: int = 0,
) -> dict:
    """Held-out bits per byte and next-byte accuracy (per chained position for MTP); with
    ``bytes_only=False`` (token models) bits per token over every label."""
    trainable, frozen = split_params(stage, params)
    fn = _eval_fn(stage, config, mtp_depth, bytes_only, block_first)
    tot = None
    for i in range(0, windows.shape[0], chunk):
        part = jnp.asarray(windows[i : i + chunk])
        stats = jax.device_get(fn(trainable, frozen, part))
        tot = stats if tot is None else tuple(a + b for a, b in zip(tot, stats, strict=True))
    nll, hit, cnt = (np.asarray(x, np.float64) for x in tot)
    bpb = nll / np.maximum(cnt, 1) / LN2
    acc = hit / np.maximum(cnt, 1)
    unit, count = ("byte", "bytes") if bytes_only else ("token", "eval_tokens")  # not "tokens": trained ones
    if stage in ("mtp", "block"):  # per chained draft / block position
        return {f"bits_per_{unit}": [float(x) for x in bpb], "accuracy": [float(x) for x in acc], count: int(cnt[0])}
    return {f"bits_per_{unit}": float(bpb), "accuracy": float(acc), count: int(cnt)}


_EVAL_CACHE: dict = {}


def _eval_fn(stage: str, config: ModelConfig, mtp_depth: int, bytes_only: bool, block_first: int = 0):
    key = (stage, config, mtp_depth, bytes_only, block_first)
    if key not in _EVAL_CACHE:
        loss = make_loss(stage, config, mtp_depth, bytes_only, block_first)
        _EVAL_CACHE[key] = jax.jit(lambda tr, fr, w: loss(tr, fr, w)[1])
    return _EVAL_CACHE[key]


# ----------------------------------------------------------------------------- a stage


def _manager(directory: pathlib.Path, sc: StageConfig):
    import orbax.checkpoint as ocp

    opts = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=sc.ckpt_every, create=True)
    return ocp.CheckpointManager(directory.absolute(), options=opts)


def _restore(mngr, step: int, like: dict) -> tuple[dict, dict]:
    """(state shaped like ``like``, meta) of checkpoint ``step``."""
    import orbax.checkpoint as ocp

    r = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(like), meta=ocp.args.JsonRestore()))
    return r["state"], r["meta"]


def _save(mngr, step: int, state: dict, meta: dict, force: bool = False) -> None:
    import orbax.checkpoint as ocp

    mngr.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        force=force,
    )


def run_stage(
    stage: str,
    model: Model,
    corpus: Corpus,
    sc: StageConfig,
    run_dir: str | pathlib.Path,
    *,
    resume: bool = False,
    mtp_depth: int = 3,
    progress: bool = True,
    log: Callable[[dict], None] | None = None,
    stop_at: int | None = None,
    bytes_only: bool = True,
    block_first: int = 0,
) -> tuple[Model, dict]:
    """Train one stage; returns the updated model and a summary (steps, tokens, wall
    time, final held-out metrics). Checkpoints go to ``run_dir/<stage>``. ``stop_at``
    ends the run at that step without a final checkpoint (a simulated kill).
    ``bytes_only``: the loss counts byte labels only (the byte-level bundle); ``False`` for
    token models."""
    from tqdm import tqdm

    _check_stage(stage, model, sc, mtp_depth)
    config = model.config
    directory = pathlib.Path(run_dir) / stage
    opt = make_optimizer(sc)
    trainable, frozen = split_params(stage, model.params)
    state = {"params": trainable, "opt": opt.init(trainable), "step": jnp.zeros((), jnp.int32)}
    mngr, state, meta = _start(directory, sc, stage, state, resume)
    start = int(state["step"])
    loss_fn = make_loss(stage, config, mtp_depth, bytes_only, block_first)

    update = _update_fn(loss_fn, opt)

    held = eval_windows(corpus.held_out, sc.seq_len, sc.eval_windows)
    tokens_per_step = sc.batch * sc.seq_len
    bar = tqdm(total=sc.steps, initial=start, desc=stage, disable=not progress, file=sys.stderr,
               mininterval=1.0 if sys.stderr.isatty() else 30.0, dynamic_ncols=True)
    t_last, wall0 = time.perf_counter(), float(meta["wall_s"])
    t_start = t_last
    last_eval: dict = {}
    end = sc.steps if stop_at is None else min(sc.steps, max(stop_at, start))
    for step in range(start, end):
        windows = jnp.asarray(batch_for_step(corpus.train, sc.seq_len, sc.batch, step, sc.seed))
        state, loss, gnorm = update(state, frozen, windows)
        done = step + 1
        if done % 10 == 0 or done == sc.steps:
            loss_v = float(loss)  # host sync only every 10 steps
            now = time.perf_counter()
            tps = tokens_per_step * (10 if done % 10 == 0 else 1) / max(now - t_last, 1e-9)
            t_last = now
            extra = {"bpb": _bpb(last_eval)} if last_eval else {}
            bar.set_postfix(loss=f"{loss_v:.3f}", tok_s=f"{tps:,.0f}", **extra)
            if not math.isfinite(loss_v):
                raise FloatingPointError(f"{stage}: loss became {loss_v} at step {done}")
        if done % sc.eval_every == 0 or done == sc.steps:
            last_eval = evaluate(stage, merge_params(stage, state["params"], frozen), config, held, mtp_depth,
                                 bytes_only=bytes_only, block_first=block_first)
            rec = {"stage": stage, "step": done, "tokens": done * tokens_per_step, "loss": float(loss),
                   "grad_norm": float(gnorm), "wall_s": wall0 + time.perf_counter() - t_start, **last_eval}
            meta["history"].append(rec)
            if log is not None:
                log(rec)
        meta.update(step=done, tokens=done * tokens_per_step, wall_s=wall0 + time.perf_counter() - t_start)
        if done % sc.ckpt_every == 0 or done == sc.steps:
            _save(mngr, done, state, meta, force=done == sc.steps)
        bar.update(1)
    bar.close()
    mngr.wait_until_finished()
    mngr.close()
    params = merge_params(stage, state["params"], frozen)
    summary = {k: meta[k] for k in ("stage", "tokens", "wall_s")}
    summary.update(step=int(state["step"]), stage_config=meta["stage_config"],
                   final_eval=meta["history"][-1] if meta["history"] else {})
    return Model(params, config), summary


def _check_stage(stage: str, model: Model, sc: StageConfig, mtp_depth: int) -> None:
    """A stage's model and settings, before anything compiles."""
    if stage not in RUN_STAGES:
        raise ValueError(f"stage must be one of {list(RUN_STAGES)}, got {stage!r}")
    if stage == "mtp" and "mtp" not in model.params:
        raise ValueError("stage 'mtp' needs a target with an MTP module (ModelConfig.mtp_depth >= 1)")
    if stage == "mtp" and model.config.mtp_layout == "native":
        raise ValueError("stage 'mtp' trains specjax's MTP module or an EAGLE-3 head, not a checkpoint's native one: "
                         "attach a fresh one (specjax.mtp_head.attach_mtp)")
    if stage == "block" and "block" not in model.params:
        raise ValueError("stage 'block' needs a target with a block drafter (specjax.train_block.attach_block)")
    if sc.seq_len + 1 > model.config.max_seq_len + 1 or (stage == "mtp" and sc.seq_len <= mtp_depth):
        raise ValueError(f"seq_len {sc.seq_len} does not fit max_seq_len {model.config.max_seq_len} / mtp depth")


def _start(directory: pathlib.Path, sc: StageConfig, stage: str, state: dict, resume: bool):
    """``(checkpoint manager, state, meta)``: a fresh start, or with ``resume`` the latest
    checkpoint's (whose stage settings must be ``sc``)."""
    mngr = _manager(directory, sc)
    meta: dict = {"stage": stage, "step": 0, "tokens": 0, "wall_s": 0.0, "history": [], "stage_config": {}}
    if resume and mngr.latest_step() is not None:
        state, meta = _restore(mngr, mngr.latest_step(), state)
        if meta.get("stage_config") != dataclasses.asdict(sc):
            raise ValueError(
                f"{directory}: --resume with different stage settings than the checkpoint "
                f"({meta.get('stage_config')} vs {dataclasses.asdict(sc)})"
            )
    meta["stage_config"] = dataclasses.asdict(sc)
    return mngr, state, meta


def _update_fn(loss_fn: Callable, opt: optax.GradientTransformation) -> Callable:
    """One jitted optimiser step: ``(state, frozen, windows) -> (state, loss, gradient norm)``."""

    @jax.jit
    def update(state, frozen, windows):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], frozen, windows)
        upd, opt_state = opt.update(grads, state["opt"], state["params"])
        new = {"params": optax.apply_updates(state["params"], upd), "opt": opt_state, "step": state["step"] + 1}
        return new, loss, optax.tree.norm(grads)
    return update


def _bpb(ev: dict) -> str:
    b = ev["bits_per_byte"] if "bits_per_byte" in ev else ev["bits_per_token"]
    return f"{b:.3f}" if isinstance(b, float) else "/".join(f"{x:.2f}" for x in b)


def write_json_line(path: pathlib.Path, rec: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(rec) + "\n")


# ----------------------------------------------------------------------------- the whole recipe


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything ``specjax train`` does: three model configs and three stage configs."""

    target: ModelConfig
    draft: ModelConfig
    stages: dict  # stage -> StageConfig
    mtp_chain: int = 3  # chained MTP passes trained (the drafter's depth)
    max_files: int | None = None


def preset(name: str) -> Recipe:
    """``default``: the shipped bundle. ``smoke``: seconds on CPU, for tests."""
    from specjax.tokenizer import VOCAB_SIZE

    if name == "default":
        # max_seq_len = the training context: RoPE distances beyond it were never seen, and
        # the per-row caches (and the XLA attention over them) are sized by it
        target = ModelConfig(vocab_size=VOCAB_SIZE, d_model=256, n_layers=6, n_heads=4, n_kv_heads=4, d_ff=704,
                             max_seq_len=256, mtp_depth=1)
        draft = ModelConfig(vocab_size=VOCAB_SIZE, d_model=128, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=384,
                            max_seq_len=256, mtp_depth=0)
        stages = {
            "target": StageConfig(steps=1500, batch=16, seq_len=256, lr=2e-3, warmup=100),
            "mtp": StageConfig(steps=300, batch=16, seq_len=256, lr=2e-3, warmup=50, eval_every=100, ckpt_every=100),
            "draft": StageConfig(steps=1200, batch=16, seq_len=256, lr=3e-3, warmup=100),
        }
        return Recipe(target, draft, stages)
    if name == "smoke":
        target = ModelConfig(vocab_size=VOCAB_SIZE, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64,
                             max_seq_len=256, mtp_depth=1)
        draft = ModelConfig(vocab_size=VOCAB_SIZE, d_model=16, n_layers=1, n_heads=1, n_kv_heads=1, d_ff=32,
                            max_seq_len=256, mtp_depth=0)
        sc = StageConfig(steps=6, batch=2, seq_len=32, lr=1e-2, warmup=2, eval_every=3, eval_windows=4, ckpt_every=3)
        return Recipe(target, draft, {s: sc for s in STAGES}, max_files=6)
    raise ValueError(f"preset must be one of ['default', 'smoke'], got {name!r}")


def train(
    recipe: Recipe,
    run_dir: str | pathlib.Path,
    out: str | pathlib.Path | None,
    *,
    resume: bool = False,
    stages: tuple[str, ...] = STAGES,
    progress: bool = True,
    corpus: Corpus | None = None,
    stop_at: int | None = None,
) -> dict:
    """Run the stages in order (each resumable) and export the bundle to ``out``.

    ``stop_at``: stop the first unfinished stage at this step, as a kill would (only
    checkpoints already written survive); nothing is exported. Returns the summary."""
    from specjax.checkpoint import save_bundle
    from specjax.corpus import build_corpus

    bad = [s for s in stages if s not in STAGES]
    if bad or not stages:
        raise ValueError(f"stages must be a non-empty subset of {list(STAGES)}, got {list(stages)}")
    run_dir = pathlib.Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if corpus is None:
        corpus = build_corpus(max_files=recipe.max_files)
    log_path = run_dir / "log.jsonl"
    summary: dict = {"corpus": corpus.describe(), "stages": {}, "target": recipe.target.to_dict(),
                     "draft": recipe.draft.to_dict(), "mtp_chain": recipe.mtp_chain}
    target = init_model(recipe.target, seed=recipe.stages["target"].seed)
    draft = init_model(recipe.draft, seed=recipe.stages["draft"].seed + 1)
    for stage in STAGES:
        sc = recipe.stages[stage]
        if stage not in stages:
            # an earlier run may have trained it: pick up its final weights
            model = target if stage != "draft" else draft
            loaded = _load_final(run_dir / stage, stage, model, sc)
            if loaded is None:
                continue
            model, info = loaded
        else:
            model = target if stage != "draft" else draft
            model, info = run_stage(stage, model, corpus, sc, run_dir, resume=resume, mtp_depth=recipe.mtp_chain,
                                    progress=progress, log=lambda r: write_json_line(log_path, r), stop_at=stop_at)
            if info["step"] < sc.steps:
                summary["stages"][stage] = info
                summary["interrupted"] = {"stage": stage, "step": info["step"]}
                return summary
        summary["stages"][stage] = info
        if stage == "draft":
            draft = model
        else:
            target = model
    if out is not None:
        final = {s: evaluate(s, (draft if s == "draft" else target).params,
                             recipe.draft if s == "draft" else recipe.target,
                             eval_windows(corpus.held_out, recipe.stages[s].seq_len, None), recipe.mtp_chain)
                 for s in summary["stages"]}
        summary["held_out_full"] = final
        have_draft = "draft" in summary["stages"]
        save_bundle(out, target, draft if have_draft else None, training=summary)
        summary["out"] = str(out)
    return summary


def _load_final(directory: pathlib.Path, stage: str, model: Model, sc: StageConfig):
    """Final weights of a finished stage from its checkpoints, or None if not trained."""

    if not directory.is_dir():
        return None
    mngr = _manager(directory, sc)
    step = mngr.latest_step()
    if step is None:
        return None
    trainable, frozen = split_params(stage, model.params)
    opt = make_optimizer(sc)
    abstract = {"params": trainable, "opt": opt.init(trainable), "step": jnp.zeros((), jnp.int32)}
    state, meta = _restore(mngr, step, abstract)
    mngr.close()
    if meta["step"] != sc.steps:
        raise ValueError(f"{directory}: stage {stage!r} stopped at step {meta['step']} of {sc.steps}; "
                         f"train it (with --resume) before using it")
    info = {k: meta[k] for k in ("stage", "step", "tokens", "wall_s")}
    info["stage_config"] = meta["stage_config"]
    info["final_eval"] = meta["history"][-1] if meta["history"] else {}
    return Model(merge_params(stage, state["params"], frozen), model.config), info
