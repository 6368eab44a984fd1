"""What a generation reports: ``GenerationResult`` and its metrics, read from the final
engine state on the host."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from specjax.tree import tree_spec

__all__ = ["GenerationResult", "metrics", "tokens"]


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """What ``generate`` returns.

    ``tokens``: the new tokens of each prompt, in order (EOS included when hit).
    ``metrics`` (all over active decode steps; the first token comes from prefill):

    * ``emitted``: tokens the decode steps produced; ``total_row_steps``: steps summed over rows;
      ``steps``: steps of the longest row.
    * ``tok_per_step`` = ``emitted / total_row_steps`` (what a row gains per target forward;
      cut at EOS and the token budget) and ``row_tok_per_step`` per row.
    * ``accepted_drafts``: drafts accepted *and emitted* (a draft accepted past an EOS or the
      token budget is not counted); ``mean_accepted_drafts`` = that per row-step.
    * ``mean_accepted_length`` = ``(accepted_drafts + total_row_steps) / total_row_steps``:
      emitted drafts plus the verifier's own token per step. It equals ``tok_per_step``
      except on a row's last step, when EOS or the budget cuts the verifier's token.
    * ``acceptance_per_position``: accepted / proposed at draft position ``k`` and
      ``row_accepted_trace`` (accepted drafts per step per row): the verifier's decisions,
      before any EOS/budget cut (what a drafter's quality is judged by);
      ``conditional_acceptance_per_position``: accepted / verdicts at ``k``, the chance draft
      ``k`` passes once every draft before it did (what ``depth="auto"`` estimates per row), from
      ``accepted_per_position_count`` and ``verdicts_per_position_count``.
    * ``proposed_drafts``: drafts the rows offered; ``mean_proposed_drafts`` per row-step.
    * ``depth="auto"`` adds ``max_depth``, ``windows`` and ``window_share`` (the share of steps
      taken at each window), ``depth_rule`` (``"makespan"`` for a static batch, or the given
      ``DepthPolicy``'s rule), ``cost_source`` (``"given"``, ``"cached"``, ``"measured"``),
      ``cost_seconds`` (the table's seconds a step per window at this batch) and
      ``acceptance_prior`` (each draft position's prior: the table's ``acceptance`` where given,
      else ``DepthPolicy.prior``).
    * ``compiles``: traces of the generate loop in this call (0 when the shapes were seen);
      ``seconds_compile`` (0.0 when cached), ``seconds_run`` (prefill + decode + reading the
      result back) and ``tok_per_s`` = new tokens (the first included) / ``seconds_run``.
    """

    tokens: list[list[int]]
    metrics: dict


def tokens(st) -> list[list[int]]:
    seq, plen, known = np.asarray(st.seq), np.asarray(st.prompt_len), np.asarray(st.known)
    return [seq[i, plen[i] : known[i]].tolist() for i in range(seq.shape[0])]


def metrics(st, eng: Any, compiles: int) -> dict:
    steps = np.asarray(st.steps)
    emitted = np.asarray(st.emitted)
    acc = np.asarray(st.accepted)
    total_steps = int(steps.sum())
    prop_pos, acc_pos = np.asarray(st.prop_pos), np.asarray(st.acc_pos)
    pp, verdicts = prop_pos.sum(axis=0), np.asarray(st.seen_pos).sum(axis=0)
    proposed = int(np.asarray(st.proposed).sum())
    out = {
        "tok_per_step": float(emitted.sum() / total_steps) if total_steps else 0.0,
        "row_tok_per_step": (emitted / np.maximum(steps, 1)).tolist(),
        "mean_accepted_length": float((acc.sum() + total_steps) / total_steps) if total_steps else 0.0,
        "mean_accepted_drafts": float(acc.sum() / total_steps) if total_steps else 0.0,
        "acceptance_per_position": [float(x) for x in acc_pos.sum(axis=0) / np.maximum(pp, 1)],
        # P(draft k accepted | drafts < k were): accepted at k over verdicts at k
        "conditional_acceptance_per_position": [
            float(x) for x in acc_pos.sum(axis=0) / np.maximum(verdicts, 1)],
        "accepted_per_position_count": [int(x) for x in acc_pos.sum(axis=0)],
        "verdicts_per_position_count": [int(x) for x in verdicts],
        "proposed_per_position_count": [int(x) for x in pp],
        "accepted_drafts": int(acc.sum()),
        "proposed_drafts": proposed,
        "mean_proposed_drafts": proposed / total_steps if total_steps else 0.0,
        "total_row_steps": total_steps,
        "emitted": int(emitted.sum()),
        "steps": int(steps.max()) if len(steps) else 0,
        "row_steps": steps.tolist(),
        "row_accepted_trace": [[int(x) for x in r if x >= 0] for r in np.asarray(st.trace)],
        "compiles": compiles,
        "drafter": eng.drafter.name,
        "depth": eng.depth,
        "kv_advance": eng.kv_rule.value,
        "cache": eng.cache_kind,
        "layer_loop": getattr(eng.target, "layer_loop", None),  # specjax's Llama: "unrolled" | "scan"
    }
    if getattr(eng, "tree", None) is not None:  # a tree: acceptance per draft level and sibling rank
        tested, took = np.asarray(st.branch_tested).sum(axis=0), np.asarray(st.branch_accepted).sum(axis=0)
        out.update(tree=tree_spec(eng.tree), branch_tested_count=tested.tolist(), branch_accepted_count=took.tolist(),
                   # P(rank r accepted | ranks < r rejected) at draft level j: specjax.sim.TreeAcceptance.learn
                   acceptance_per_branch=(took / np.maximum(tested, 1)).tolist())
    if eng.controller is not None:  # depth="auto": what it chose and by what
        out.update(eng.controller.metrics(eng, st))
    return out
