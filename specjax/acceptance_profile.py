"""Acceptance profiles for ``specjax.scale``'s controlled drafts: the conditional acceptance per
draft position (and per tree branch) a bench row is run at, from the bundled model's MTP head
measured now or given as numbers (``acceptance_profile``, ``tree_profile``)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from specjax.controlled import expected_tokens_per_step

__all__ = ["acceptance_profile", "expected_tree_tokens", "trace_rows", "tree_profile"]


def _bundled_metrics(depth: int, n_prompts: int, max_new_tokens: int, tree: object = None) -> list[dict]:
    """The bundled model's MTP head at ``depth`` (drafting ``tree`` if given), greedy, on the
    bench's held-out prompts, eight at a time: each run's metrics."""
    from specjax.bench import bench_prompts
    from specjax.checkpoint import load_model
    from specjax.generation import generate

    bundle = load_model()
    toks = bundle.encode_prompts(bench_prompts(n_prompts), bos=False)
    return [generate(bundle.model, toks[i : i + 8], max_new_tokens=max_new_tokens, drafter="mtp", depth=depth,
                     tree=tree, temperature=0.0, eos_id=bundle.tokenizer.eos_id).metrics
            for i in range(0, len(toks), 8)]


@functools.lru_cache(maxsize=2)
def _bundled_run(depth: int, n_prompts: int, max_new_tokens: int) -> tuple[tuple[float, ...], tuple]:
    """The bundled MTP head's chain run (``_bundled_metrics``): (conditional acceptance per draft
    position, each row's accepted count per step)."""
    verdicts, accepted, traces = np.zeros(depth), np.zeros(depth), []
    for m in _bundled_metrics(depth, n_prompts, max_new_tokens):
        verdicts += m["verdicts_per_position_count"]
        accepted += m["accepted_per_position_count"]
        traces += m["row_accepted_trace"]
    return tuple(float(x) for x in accepted / np.maximum(verdicts, 1)), tuple(tuple(t) for t in traces)


@functools.lru_cache(maxsize=4)
def _bundled_tree_run(tree: object, depth: int, n_prompts: int, max_new_tokens: int) -> tuple[tuple[float, ...], ...]:
    """The bundled MTP head drafting ``tree`` to ``depth`` (``_bundled_metrics``): its acceptance
    per branch ``[depth, ranks]`` (``TreeAcceptance.learn``)."""
    from specjax.sim import TreeAcceptance

    tested, took = 0, 0
    for m in _bundled_metrics(depth, n_prompts, max_new_tokens, tree):
        tested = tested + np.asarray(m["branch_tested_count"])
        took = took + np.asarray(m["branch_accepted_count"])
    metrics = {"branch_tested_count": tested.tolist(), "branch_accepted_count": took.tolist()}
    rates = TreeAcceptance.learn(metrics, (tested.shape[1],) * min(depth, tested.shape[0])).rates
    return tuple(tuple(float(x) for x in r) for r in np.asarray(rates))


def tree_profile(spec: str, tree: object, depth: int, rates: Sequence[float]) -> list[list[float]]:
    """A tree row's acceptance per branch ``[depth, ranks]`` (``Controlled``'s ``branch``) under
    the acceptance ``spec``: ``bundled`` and ``bundled-traces``: the bundled model's MTP head's,
    measured now on the same tree (``_bundled_tree_run``: the bench's 64 held-out prompts, 128
    tokens each); ``iid:P`` and ``rates:...``: every rank at its level's rate (``rates``)."""
    from specjax.tree import DynamicTree

    if spec.partition(":")[0] in ("bundled", "bundled-traces"):
        return [list(r) for r in _bundled_tree_run(tree, depth, 64, 128)]
    ranks = tree.topk if isinstance(tree, DynamicTree) else max(tree)
    return [[float(r)] * ranks for r in list(rates)[:depth]]


def expected_tree_tokens(branch: Sequence[Sequence[float]], tree: object) -> float | None:
    """Tokens a step of the preset ``tree`` emits at acceptance per branch ``branch`` (levels are
    independent: level ``j`` passes with ``1 - prod_r (1 - branch[j][r])`` over its ranks);
    ``None`` for a dynamic tree (its shape is data)."""
    if not isinstance(tree, tuple):
        return None
    p = [1.0 - float(np.prod([1.0 - x for x in branch[j][:k]])) for j, k in enumerate(tree)]
    return expected_tokens_per_step(p, len(tree))


def acceptance_profile(spec: str, depth: int = 3) -> dict:
    """``spec`` -> ``{"spec", "rates" [depth], "trace" ([rows][steps] or None)}``:

    * ``bundled``: the bundled model's MTP head's conditional acceptance per position (measured
      now: its depth-``depth`` greedy run on the bench's 64 held-out prompts, 128 tokens each);
    * ``bundled-traces``: the same run's per-row accepted counts replayed step by step (row ``i``
      of a batch replays run row ``i mod 64``; past a trace's end, ``rates``);
    * ``iid:P``: every draft right with probability ``P``;
    * ``rates:P1,P2,...``: conditional acceptance per position (the last repeats)."""
    kind, _, arg = spec.partition(":")
    if kind in ("bundled", "bundled-traces") and not arg:
        rates, traces = _bundled_run(depth, 64, 128)
        return {"spec": spec, "rates": list(rates), "trace": [list(t) for t in traces] if kind != "bundled" else None}
    try:
        if kind == "iid" and arg:
            rates = [float(arg)] * depth
        elif kind == "rates" and arg:
            given = [float(x) for x in arg.split(",")]
            rates = (given + [given[-1]] * depth)[:depth]
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"acceptance={spec!r} is invalid: must be bundled, bundled-traces, iid:P or "
                         "rates:P1,P2,...") from None
    if not all(0.0 <= r <= 1.0 for r in rates):
        raise ValueError(f"acceptance={spec!r} is invalid: each rate must lie in [0, 1]")
    return {"spec": spec, "rates": rates, "trace": None}


def trace_rows(trace: list[list[int]] | None, batch: int) -> np.ndarray | None:
    if not trace:
        return None
    rows = [trace[i % len(trace)] for i in range(batch)]
    out = np.full((batch, max(len(r) for r in rows) or 1), -1, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
