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

from specjax.attention import attend_visible
from specjax.corpus import Corpus
from specjax.model import Model, ModelConfig, init_model, logits
from specjax.model.block import block_logits, train_block_hidden
from specjax.model.layers import block_finish, project_qkv
from specjax.model.llama import hidden_states, mtp_attention_input, mtp_logits, mtp_source

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
FROZEN_IDS = "mtp_draft_ids"  # where split_params keeps a draft vocabulary's ids among the frozen params
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


# ----------------------------------------------------------------------------- losses


def _ce(logits: jax.Array, labels: jax.Array, bytes_only: bool, valid: jax.Array | None = None,
        count_labels: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Summed cross-entropy (nats), correct count and count over the labels that count: byte
    labels (``< 256``, not BOS/EOS) for the byte-level bundle, every label for token models.
    ``valid``: labels that can be hit at all (a draft vocabulary's; the others count as misses
    and stay out of the loss); ``count_labels``: the labels the count is taken over (default
    ``labels``)."""
    over = labels if count_labels is None else count_labels
    mask = over < 256 if bytes_only else over >= 0
    lp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(lp, labels[..., None], axis=-1)[..., 0]
    hit = jnp.argmax(logits, axis=-1) == labels
    can = mask if valid is None else mask & valid
    return jnp.sum(nll * can), jnp.sum(hit & can), jnp.sum(mask)


def _chain_attention(q, k1, v1, extra_k: list, extra_v: list) -> jax.Array:
    """Query row ``i`` sees pass-1 keys ``j <= i`` plus the chain's own keys at row ``i``
    (the MTP cache during a chained draft). ``q [B, T, H, D]``, keys ``[B, T, Hkv, D]``.
    The same attention core as inference: the chain keys are appended after the pass-1
    keys and the visibility mask is causal on the first block, the diagonal on the rest."""
    t = q.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    eye = jnp.eye(t, dtype=bool)
    ok = jnp.concatenate([causal] + [eye] * len(extra_k), axis=-1)[None]  # [1, T, T * (1 + n)]
    k = jnp.concatenate([k1, *extra_k], axis=1).transpose(0, 2, 1, 3)  # head-major [B, Hkv, T', D]
    v = jnp.concatenate([v1, *extra_v], axis=1).transpose(0, 2, 1, 3)
    return attend_visible(q, k, v, ok)


def mtp_chain_logits(params: dict, config: ModelConfig, hidden: jax.Array, tokens: jax.Array, depth: int):
    """Teacher-forced MTP chain as the drafter runs it: pass ``k`` (1-based) at row ``i``
    takes (hidden, token ``t_{i+k}``) at position ``i + k - 1`` and predicts ``t_{i+k+1}``;
    pass 1's hidden is the target's (as the module reads it: ``mtp_source``), pass ``k > 1``'s
    is pass ``k - 1``'s output. ``hidden [B, T, d]`` (rows ``0..T-1``), ``tokens [B, T + depth]``.
    Returns ``depth`` logits ``[B, T, V]``."""
    m, mc = params["mtp"], config.mtp_config
    b, t, _ = hidden.shape
    rows = jnp.arange(t, dtype=jnp.int32)[None]
    h, out, ks, vs = hidden, [], [], []
    k1 = v1 = None
    for k in range(1, depth + 1):
        h_in, x = mtp_attention_input(params, config, h, tokens[:, k : k + t])
        q, kk, vv = project_qkv(m["block"], h_in, jnp.broadcast_to(rows + k - 1, (b, t)), mc, None)
        if k == 1:
            k1, v1 = kk, vv
            attn = _chain_attention(q, k1, v1, [], [])
        else:
            ks.append(kk)
            vs.append(vv)
            attn = _chain_attention(q, k1, v1, ks, vs)
        h = block_finish(m["block"], x, attn, mc)
        out.append(mtp_logits(params, config, h))  # over the draft vocabulary, if the module has one
    return out


def _draft_labels(params: dict, config: ModelConfig, labels: jax.Array) -> jax.Array:
    """Target-token ``labels`` as indices into the MTP module's draft vocabulary (-1 outside it)."""
    ids = params["mtp"]["draft_ids"]
    index = jnp.full((config.vocab_size,), -1, jnp.int32).at[ids].set(jnp.arange(ids.shape[0], dtype=jnp.int32))
    return jnp.where(labels >= 0, index[jnp.clip(labels, 0, config.vocab_size - 1)], -1)


ANCHOR_STRIDE = 16  # the block stage: one block per 16 positions of a window (its offset shifts them)


def anchors_for(windows: jax.Array, k: int, first: int) -> jax.Array:
    """int32 ``[B, A]``: the blocks' anchors of each window, every ``ANCHOR_STRIDE`` positions from
    ``first`` (the prompt's last token: every label is the target's), shifted by an offset
    the window's own first token picks (each step sees other anchors; the loss stays a pure
    function of the window)."""
    t = windows.shape[1] - 1
    n = max(1, (t - k - first) // ANCHOR_STRIDE)
    offset = windows[:, :1] % ANCHOR_STRIDE
    return jnp.minimum(first + offset + ANCHOR_STRIDE * jnp.arange(n, dtype=jnp.int32)[None], t - 2)


def block_loss(config: ModelConfig, first: int, bytes_only: bool):
    """``loss(params, windows [B, T + 1]) -> (mean CE over block positions, (nll [k-1], hits [k-1],
    count [k-1]))`` (sums per block position). The target's params are frozen by the caller
    (``run_stage``'s split); its hidden states are held constant here too."""
    k = config.block_size

    def loss(params, windows):
        tokens = windows[:, :-1]
        _, hidden = hidden_states(Model(params, config), tokens, taps=config.block_taps)
        taps = jax.lax.stop_gradient(hidden[..., config.d_model:])
        anchors = anchors_for(windows, k, first)
        x = train_block_hidden(params, config, taps, tokens, anchors)  # [B, A, k, d]
        logits = block_logits(params, config, x[:, :, 1:])  # [B, A, k - 1, V]
        at = anchors[:, :, None] + 1 + jnp.arange(k - 1)  # the label positions
        labels = jnp.take_along_axis(tokens, jnp.clip(at, 0, tokens.shape[1] - 1).reshape(at.shape[0], -1),
                                     axis=1).reshape(at.shape)
        ok = (at < tokens.shape[1]) & ((labels < 256) if bytes_only else (labels >= 0))
        lp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(lp, labels[..., None], axis=-1)[..., 0]
        hit = jnp.argmax(logits, axis=-1) == labels
        axes = (0, 1)
        nll_j, hit_j, cnt_j = (jnp.sum(jnp.where(ok, a, 0), axis=axes) for a in (nll, hit, ok))
        return jnp.mean(nll_j / jnp.maximum(cnt_j, 1)), (nll_j, hit_j, cnt_j)

    return loss


def make_loss(stage: str, config: ModelConfig, mtp_depth: int, bytes_only: bool = True, block_first: int = 0
              ) -> Callable:
    """``loss(trainable, frozen, windows [B, T + 1]) -> (loss, (nll_sum, hits, count))``
    (``block_first``: the block stage's first anchor, ``specjax.train_block.block_loss``)."""
    if stage == "block":
        inner = block_loss(config, block_first, bytes_only)
        return lambda trainable, frozen, windows: inner(_merge(stage, trainable, frozen), windows)
    if stage in ("target", "draft"):

        def loss(trainable, frozen, windows):
            lg = logits(Model(trainable, config), windows[:, :-1])
            nll, hit, cnt = _ce(lg, windows[:, 1:], bytes_only)
            return nll / jnp.maximum(cnt, 1), (nll, hit, cnt)

        return loss

    def mtp_loss(trainable, frozen, windows):
        params = _merge("mtp", trainable, frozen)
        tokens = windows[:, :-1]
        t = tokens.shape[1] - mtp_depth
        _, hidden = hidden_states(Model(params, config), tokens, taps=config.mtp_taps)
        hidden = jax.lax.stop_gradient(hidden)[:, :t]  # the target stays frozen
        hidden = mtp_source(params, config, hidden)  # an EAGLE-3 head's fc over the taps is trained
        lgs = mtp_chain_logits(params, config, hidden, windows, mtp_depth)
        total, stats = 0.0, []
        for k, lg in enumerate(lgs, start=1):
            labels = windows[:, k + 1 : k + 1 + t]
            if config.mtp_draft_vocab:  # a label outside the draft vocabulary is a miss, out of the loss
                drafted = _draft_labels(params, config, labels)
                nll, hit, cnt = _ce(lg, jnp.maximum(drafted, 0), bytes_only, drafted >= 0, count_labels=labels)
            else:
                nll, hit, cnt = _ce(lg, labels, bytes_only)
            total = total + nll / jnp.maximum(cnt, 1)
            stats.append((nll, hit, cnt))
        nll, hit, cnt = (jnp.stack(s) for s in zip(*stats, strict=True))
        return total / mtp_depth, (nll, hit, cnt)

    return mtp_loss


# ----------------------------------------------------------------------------- optimiser


def make_optimizer(sc: StageConfig) -> optax.GradientTransformation:
    sched = optax.warmup_cosine_decay_schedule(0.0, sc.lr, max(sc.warmup, 1), sc.steps, sc.lr * sc.min_lr_ratio)
    decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # noqa: E731 (no decay on norms/biases)
    return optax.chain(
        optax.clip_by_global_norm(sc.clip),
        optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=sc.weight_decay, mask=decay_mask),
    )


def split_params(stage: str, params: dict) -> tuple[dict, dict]:
    """(trainable, frozen) of a stage: the MTP stage trains only ``params['mtp']``, the block
    stage only ``params['block']``."""
    if stage == "block":
        return params["block"], {k: v for k, v in params.items() if k != "block"}
    if stage == "mtp":  # a draft vocabulary's ids are data, not weights: they stay frozen
        mtp = params["mtp"]
        frozen = {k: v for k, v in params.items() if k != "mtp"}
        if "draft_ids" in mtp:
            frozen[FROZEN_IDS] = mtp["draft_ids"]
        return {k: v for k, v in mtp.items() if k != "draft_ids"}, frozen
    return {k: v for k, v in params.items() if k != "mtp"}, {k: v for k, v in params.items() if k == "mtp"}


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

    if stage not in RUN_STAGES:
        raise ValueError(f"stage must be one of {list(RUN_STAGES)}, got {stage!r}")
    if stage == "mtp" and "mtp" not in model.params:
        raise ValueError("stage 'mtp' needs a target with an MTP module (ModelConfig.mtp_depth >= 1)")
    if stage == "mtp" and model.config.mtp_layout == "native":
        raise ValueError("stage 'mtp' trains specjax's MTP module or an EAGLE-3 head, not a checkpoint's native one: "
                         "attach a fresh one (specjax.mtp_head.attach_mtp)")
    if stage == "block" and "block" not in model.params:
        raise ValueError("stage 'block' needs a target with a block drafter (specjax.train_block.attach_block)")
    config = model.config
    if sc.seq_len + 1 > config.max_seq_len + 1 or (stage == "mtp" and sc.seq_len <= mtp_depth):
        raise ValueError(f"seq_len {sc.seq_len} does not fit max_seq_len {config.max_seq_len} / mtp depth")
    directory = pathlib.Path(run_dir) / stage
    opt = make_optimizer(sc)
    trainable, frozen = split_params(stage, model.params)
    state = {"params": trainable, "opt": opt.init(trainable), "step": jnp.zeros((), jnp.int32)}
    mngr = _manager(directory, sc)
    meta: dict = {"stage": stage, "step": 0, "tokens": 0, "wall_s": 0.0, "history": [], "stage_config": {}}
    if resume and mngr.latest_step() is not None:
        step0 = mngr.latest_step()
        state, meta = _restore(mngr, step0, state)
        if meta.get("stage_config") != dataclasses.asdict(sc):
            raise ValueError(
                f"{directory}: --resume with different stage settings than the checkpoint "
                f"({meta.get('stage_config')} vs {dataclasses.asdict(sc)})"
            )
    meta["stage_config"] = dataclasses.asdict(sc)
    start = int(state["step"])
    loss_fn = make_loss(stage, config, mtp_depth, bytes_only, block_first)

    @jax.jit
    def update(state, frozen, windows):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], frozen, windows)
        upd, opt_state = opt.update(grads, state["opt"], state["params"])
        new = {"params": optax.apply_updates(state["params"], upd), "opt": opt_state, "step": state["step"] + 1}
        return new, loss, optax.tree.norm(grads)

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
            last_eval = evaluate(stage, _merge(stage, state["params"], frozen), config, held, mtp_depth,
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
    params = _merge(stage, state["params"], frozen)
    summary = {k: meta[k] for k in ("stage", "tokens", "wall_s")}
    summary["step"] = int(state["step"])
    summary["stage_config"] = meta["stage_config"]
    summary["final_eval"] = meta["history"][-1] if meta["history"] else {}
    return Model(params, config), summary


def _bpb(ev: dict) -> str:
    b = ev["bits_per_byte"] if "bits_per_byte" in ev else ev["bits_per_token"]
    return f"{b:.3f}" if isinstance(b, float) else "/".join(f"{x:.2f}" for x in b)


def _merge(stage: str, trainable: dict, frozen: dict) -> dict:
    if stage == "block":
        return dict(frozen, block=trainable)
    if stage != "mtp":
        return dict(trainable, **frozen)
    rest = {k: v for k, v in frozen.items() if k != FROZEN_IDS}
    return dict(rest, mtp=dict(trainable, draft_ids=frozen[FROZEN_IDS]) if FROZEN_IDS in frozen else trainable)


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
    return Model(_merge(stage, state["params"], frozen), model.config), info
