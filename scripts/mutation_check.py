"""Mutation check: apply deliberate bugs one at a time and require a test to fail.

    python scripts/mutation_check.py            # all mutations
    python scripts/mutation_check.py --list     # names only
    python scripts/mutation_check.py -k cohort  # those whose name contains "cohort"
    python scripts/mutation_check.py -j 1       # one at a time (default: one per core, at most 8)

Each mutation replaces one exact snippet (which must occur exactly once) in one
source file, reruns the named tests with ``pytest -x``, and restores the file. A
mutation that leaves the tests green is *missed*; the script exits 1 if any is.
Mutations are applied to copies of the tree in a temporary folder (one per job, so
parallel jobs never see each other's edits), never to the checkout: a run killed
midway leaves the sources as they were.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS: list[Mutation] = [
    # --- plan rules (foundation) ---
    Mutation(
        "per-sequence committed capped by the batch min",
        "specjax/plan.py",
        "    return committed\n",
        "    return jnp.minimum(committed, jnp.min(committed, axis=-1, keepdims=True))\n",
        ("tests/test_plan.py", "tests/test_sim.py"),
    ),
    Mutation(
        "per-sequence next_uncached follows the cohort rule",
        "specjax/plan.py",
        "PerSeqStepPlan(**_plan_core(u, a, window, _own_advance))",
        "PerSeqStepPlan(**_plan_core(u, a, window, _cohort_advance))",
        ("tests/test_plan.py", "tests/test_sim.py"),
    ),
    Mutation(
        "saturation cap removed (saturated rows still accept drafts)",
        "specjax/plan.py",
        "    return jnp.minimum(prefix_len, proposed)\n",
        "    return prefix_len\n",
        ("tests/test_plan.py", "tests/test_sim.py"),
    ),
    Mutation(
        "invariant's min replaced by mean",
        "specjax/plan.py",
        "    return jnp.min(committed, axis=-1, keepdims=True)\n",
        "    return jnp.mean(committed, axis=-1, keepdims=True).astype(committed.dtype)\n",
        ("tests/test_plan.py", "tests/test_sim.py"),
    ),
    # --- caches, masks, attention ---
    Mutation(
        "mask drops the j >= lead_pad condition",
        "specjax/masks.py",
        "ok = (kp >= lead_pad[:, None, None]) & (kp <= qp) & (kp >= 0)",
        "ok = (kp <= qp) & (kp >= 0)",
        ("tests/test_masks_attention.py", "tests/test_caches.py"),
    ),
    Mutation(
        "dense write at offset 0 instead of the row offset",
        "specjax/cache/dense.py",
        "        pos = positions(self.lengths, t)\n",
        "        pos = positions(jnp.zeros_like(self.lengths), t)\n",
        ("tests/test_caches.py",),
    ),
    Mutation(
        "dense write at one shared offset (row 0's)",
        "specjax/cache/dense.py",
        "        pos = positions(self.lengths, t)\n",
        "        pos = positions(jnp.full_like(self.lengths, self.lengths[0]), t)\n",
        ("tests/test_caches.py",),
    ),
    Mutation(
        "paged rollback does not free pages",
        "specjax/cache/paged.py",
        "num_free=self.num_free + jnp.sum(flat),",
        "num_free=self.num_free,",
        ("tests/test_caches.py",),
    ),
    Mutation(
        "paged allocation hands every row the same pages",
        "specjax/cache/paged.py",
        "first = jnp.cumsum(need) - need",
        "first = jnp.zeros_like(need)",
        ("tests/test_caches.py",),
    ),
    Mutation(
        "rolling ring positions ignore the slack",
        "specjax/cache/rolling.py",
        "return ring_positions(self.lengths, t_q, self.size)",
        "return ring_positions(self.lengths, t_q, self.window)",
        ("tests/test_caches.py",),
    ),
    Mutation(
        "capability check never refusing",
        "specjax/cache/capability.py",
        '    batch = None\n    for path, slot in _slots(cache, "cache"):',
        '    batch = None\n    return None\n    for path, slot in _slots(cache, "cache"):',
        ("tests/test_caches.py",),
    ),
    Mutation(
        "capacity guard removed (overflowing rows written anyway)",
        "specjax/cache/dense.py",
        "        fits = self.lengths + n <= self.capacity\n",
        "        fits = self.lengths >= 0\n",
        ("tests/test_caches.py",),
    ),
    Mutation(
        "fully masked query returns the mean of V instead of zeros",
        "specjax/attention.py",
        "    p = jnp.where(ok, jnp.exp(s - m), 0.0)  # a query with no visible key: all zeros\n",
        "    p = jnp.exp(s - m)\n",
        ("tests/test_masks_attention.py",),
    ),
    # --- Pallas kernels ---
    Mutation(
        "kernel drops the lead-pad term",
        "pallas_kernels/_online_softmax.py",
        "ok = (kp >= lead) & (kp <= q_pos) & (kp >= 0)",
        "ok = (kp <= q_pos) & (kp >= 0)",
        ("tests/test_pallas_kernels.py",),
    ),
    Mutation(
        "kernel drops block skipping's lower bound",
        "pallas_kernels/_online_softmax.py",
        "    return lo // block, jnp.where(hi >= lo, hi // block, lo // block - 1)",
        "    return 0 * lo, jnp.where(hi >= lo, hi // block, lo // block - 1)",
        ("tests/test_pallas_kernels.py",),
    ),
    Mutation(
        "kernel causal offset off by one",
        "pallas_kernels/_online_softmax.py",
        "q_pos = q_start + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) % t_q",
        "q_pos = q_start + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) % t_q + 1",
        ("tests/test_pallas_kernels.py",),
    ),
    # --- engine ---
    Mutation(
        "verify accepts one past the first mismatch",
        "specjax/verify.py",
        "    a = _leading(ok)\n    bonus = jnp.take_along_axis(tgt",
        "    a = jnp.minimum(_leading(ok) + 1, proposed)\n    bonus = jnp.take_along_axis(tgt",
        ("tests/test_engine.py::test_greedy_speculative_equals_plain",),
    ),
    Mutation(
        "rejection sampling resamples from p instead of the residual",
        "specjax/verify.py",
        "    final = jnp.where(rejected[:, None], resid, p_next)\n",
        "    final = p_next\n",
        ("tests/test_engine.py::test_speculative_sampling_matches_the_target_distribution",),
    ),
    Mutation(
        "cohort surplus not re-fed",
        "specjax/engine.py",
        "u=jnp.where(active, plan.next_uncached, u)",
        "u=jnp.where(active, 1, u)",
        ("tests/test_engine.py::test_greedy_speculative_equals_plain",),
    ),
    Mutation(
        "per-row key replaced by a shared key",
        "specjax/sampling.py",
        "    base = jax.vmap(jax.random.key)(seeds)\n",
        "    base = jax.vmap(jax.random.key)(jnp.zeros_like(seeds))\n",
        ("tests/test_engine.py::test_sampling_rows_are_batch_invariant_and_seeded",
         "tests/test_engine.py::test_speculative_sampling_matches_the_target_distribution"),
    ),
    Mutation(
        "finished rows take part in the cohort minimum",
        "specjax/engine.py",
        "plan = plan_step(u, jnp.where(active, a, w - u), w, eng.kv_rule)",
        "plan = plan_step(u, jnp.where(active, a, 0), w, eng.kv_rule)",
        ("tests/test_engine.py::test_finished_rows_do_not_hold_back_the_cohort",),
    ),
    Mutation(
        "draft model cache never advances",
        "specjax/drafter.py",
        "        return dstate.advance(advance)\n",
        "        return dstate\n",
        ("tests/test_engine.py::test_greedy_speculative_equals_plain",),
    ),
    Mutation(
        "MTP cache never advances",
        "specjax/drafter.py",
        "return dstate.replace(cache=cache.advance(advance), h=h, first=tok, first_probs=first_probs)",
        "return dstate.replace(cache=cache, h=h, first=tok, first_probs=first_probs)",
        ("tests/test_engine.py::test_mtp_first_draft_matches_uncached_mtp",),
    ),
    # --- lean step: live range, request-sized capacity, kernels in the model ---
    Mutation(
        "XLA live range stops one key block too early",
        "specjax/attention.py",
        "    stop = jnp.clip(hi // block + 1, first, num_blocks)\n",
        "    stop = jnp.clip(hi // block, first, num_blocks)\n",
        ("tests/test_masks_attention.py::test_live_attention_never_reads_blocks_past_the_longest_row",),
    ),
    Mutation(
        "paged XLA path misses a page (pool page 0 read as unowned)",
        "specjax/attention.py",
        "    key_pos = jnp.where((bt >= 0)[:, :, None], pos, -1).reshape(b, mp * ps)\n",
        "    key_pos = jnp.where((bt > 0)[:, :, None], pos, -1).reshape(b, mp * ps)\n",
        ("tests/test_caches.py",),
    ),
    Mutation(
        "request capacity one slot short",
        "specjax/engine.py",
        "    need = max(prompt_width, 1) + max_new_tokens + 2 * w - 1\n",
        "    need = max(prompt_width, 1) + max_new_tokens + 2 * w - 2\n",
        ("tests/test_lean_step.py::test_capacity_is_exact_for_a_finished_row_under_a_draft_model",),
    ),
    Mutation(
        "ring kernel ignores the wraparound (slot index taken as position)",
        "pallas_kernels/_online_softmax.py",
        "    p = hi - jax.lax.rem(jax.lax.rem(hi - s, ring) + ring, ring)\n",
        "    p = s\n",
        ("tests/test_pallas_kernels.py::test_ring_kernel_matches_reference",),
    ),
    Mutation(
        "MTP draft taken from the logits one position past the last commit",
        "specjax/drafter.py",
        "        last = jnp.maximum(count - 1, 0)  # (a padding row of a prefill commits 0)\n",
        "        last = jnp.minimum(count, t - 1)\n",
        ("tests/test_engine.py::test_mtp_first_draft_matches_uncached_mtp",),
    ),
    Mutation(
        "MTP one-slot block: the query attends at the row's length, not at its slot",
        "specjax/model/llama.py",
        "q, x, view = one(q), one(x), cache.replace(lengths=cache.lengths + at)",
        "q, x, view = one(q), one(x), cache",
        ("tests/test_model.py::test_mtp_block_at_one_slot_equals_that_slot_of_the_full_block",
         "tests/test_engine.py::test_mtp_first_draft_matches_uncached_mtp"),
    ),
    Mutation(
        "MTP drafter on a model without the one-slot block keeps the window's last slot",
        "specjax/drafter.py",
        "            h = jnp.take_along_axis(mtp_out, last[:, None, None], axis=1)[:, 0]\n",
        "            h = mtp_out[:, -1]\n",
        ("tests/test_engine.py::test_mtp_drafter_on_a_model_without_the_one_slot_block_drafts_the_same",),
    ),
    # --- Hugging Face loading ---
    Mutation(
        "loader maps q_proj into k's place",
        "specjax/hf.py",
        '"wk": r.get(pre + "self_attn.k_proj.weight", (d, nkv), transpose=True),',
        '"wk": r.get(pre + "self_attn.q_proj.weight", (d, nq), transpose=True)[:, :nkv],',
        ("tests/test_hf.py::test_logits_match_transformers",),
    ),
    Mutation(
        "Mistral loaded without its sliding window",
        "specjax/hf.py",
        'sliding = raw.get("sliding_window") if arch in ("MistralForCausalLM", "Gemma3ForCausalLM") else None',
        "sliding = None",
        ("tests/test_hf.py::test_logits_match_transformers",),
    ),
    # --- training, bundles, bench (bundled model) ---
    Mutation(
        "MTP training chain does not see its own earlier chain keys",
        "specjax/train.py",
        "            attn = _chain_attention(q, k1, v1, ks, vs)\n",
        "            attn = _chain_attention(q, k1, v1, ks[-1:], vs[-1:])\n",
        ("tests/test_train.py::test_mtp_chain_logits_match_the_cached_drafter_chain",),
    ),
    Mutation(
        "data position ignores the step within an epoch",
        "specjax/train.py",
        "        g = step * batch + i\n",
        "        g = (step % 2) * batch + i\n",
        ("tests/test_train.py::test_batches_are_a_pure_function_of_step_and_cover_each_epoch",),
    ),
    Mutation(
        "resume restarts the data stream at step 0",
        "specjax/train.py",
        "batch_for_step(corpus.train, sc.seq_len, sc.batch, step, sc.seed)",
        "batch_for_step(corpus.train, sc.seq_len, sc.batch, step - start, sc.seed)",
        ("tests/test_train.py::test_resume_continues_at_the_same_step_and_data",),
    ),
    Mutation(
        "bits/byte counts BOS/EOS labels as bytes",
        "specjax/train.py",
        "    mask = over < 256 if bytes_only else over >= 0\n",
        "    mask = over >= 0\n",
        ("tests/test_train.py::test_bits_per_byte_counts_byte_labels_only",),
    ),
    Mutation(
        "truncated checkpoint surfaces orbax's own exception",
        "specjax/checkpoint.py",
        "    except Exception as e:  # orbax/tensorstore raise many types; name the file instead\n",
        "    except KeyError as e:\n",
        ("tests/test_bundle.py::test_truncated_or_missing_tensors_are_clear",),
    ),
    Mutation(
        "stream drops the first token of every chunk",
        "specjax/streaming.py",
        "        new = [toks[r, : n_new[r]].tolist() for r in range(toks.shape[0])]\n",
        "        new = [toks[r, 1 : n_new[r]].tolist() for r in range(toks.shape[0])]\n",
        ("tests/test_bundle.py::test_bundle_generate_and_stream_agree",),
    ),
    Mutation(
        "bench tok/step divides by the last batch's steps only",
        "specjax/bench.py",
        '            "tok_per_step": n["emitted"] / steps,\n',
        '            "tok_per_step": n["emitted"] / max(m["total_row_steps"], 1),\n',
        ("tests/test_bundle.py::test_bench_rows_and_batch_invariance",),
    ),
    Mutation(
        "refill keeps the old row's cache lengths",
        "specjax/cache/dense.py",
        "v=kv(self.v, sub.v), lengths=put(self.lengths, sub.lengths),",
        "v=kv(self.v, sub.v), lengths=self.lengths,",
        ("tests/test_batch.py::test_refilled_rows_equal_generate_alone[dense-ngram]",),
    ),
    Mutation(
        "refill keeps the old row's pages",
        "specjax/cache/paged.py",
        "        pool = self.release(mask)\n",
        "        pool = self\n",
        ("tests/test_batch.py::test_a_paged_pool_smaller_than_every_slot_makes_requests_wait_not_fail",
         "tests/test_caches.py::test_rows_view_and_put_rows_refill_rows_and_reuse_their_pages"),
    ),
    Mutation(
        "idle slots never give their pages back",
        "specjax/batch.py",
        "    cache = st.cache.release(idle)\n",
        "    cache = st.cache\n",
        ("tests/test_batch.py::test_admit_returns_the_pages_of_every_idle_slot",),
    ),
    Mutation(
        "refill keeps the old row's MTP hidden state",
        "specjax/drafter.py",
        "put(dstate.h, sub.h)",
        "dstate.h",
        ("tests/test_batch.py::test_a_refilled_slot_holds_exactly_a_fresh_prefill_of_its_request",),
    ),
    Mutation(
        "request seed derived from the slot instead of the request",
        "specjax/batch.py",
        "jnp.asarray(np.array([r.seed for r in req], np.uint32)),",
        "jnp.asarray(rows.astype(np.uint32)),",
        ("tests/test_batch.py::test_unseeded_copies_of_a_prompt_differ_and_their_seed_follows_the_id",
         "tests/test_batch.py::test_seeded_sampled_request_is_itself_in_any_batch_and_slot"),
    ),
    Mutation(
        "generate(seed=int) gives every row the same stream",
        "specjax/validate.py",
        "        seeds = [derive_seed(seed, i) for i in range(len(prompts))]\n",
        "        seeds = [seed] * len(prompts)\n",
        ("tests/test_batch.py::test_unseeded_copies_of_a_prompt_differ_and_their_seed_follows_the_id",),
    ),
    Mutation(
        "page grants in batch order: a refused row blocks rows that fit",
        "specjax/cache/paged.py",
        "        order = jnp.argsort(need, stable=True)\n",
        "        order = jnp.arange(self.batch)\n",
        ("tests/test_caches.py::test_tight_pool_serves_every_row_that_fits",),
    ),
    Mutation(
        "resume keeps a partial last line",
        "specjax/jobfile.py",
        "    if end < len(data):\n",
        "    if False:\n",
        ("tests/test_batch_cli.py::test_resume_redoes_a_partial_last_line",),
    ),
    Mutation(
        "accepted drafts cut by EOS or the budget still counted",
        "specjax/engine.py",
        "accepted=st.accepted + jnp.minimum(a, n_new) * act,",
        "accepted=st.accepted + a * act,",
        ("tests/test_default_bundle.py::test_accepted_drafts_count_only_emitted_ones",),
    ),
    # --- compressed memory (the keystone): a per-row time base under both rules ---
    Mutation(
        "compressed memory: one shared time base (blocks counted from the batch minimum)",
        "specjax/cache/compressed.py",
        "        c = (rel // self.block)[:, None] +",
        "        c = (jnp.min(rel) // self.block + 0 * rel)[:, None] +",
        ("tests/test_compressed.py",),
    ),
    Mutation(
        "compressed memory: a block pooled while it held drafts is never re-pooled (drafts leak into memory)",
        "specjax/cache/compressed.py",
        "dest = jnp.where(((c + 1) * self.block <= end[:, None]) & (c < self.slots), c, self.slots)",
        "dest = jnp.where(((c + 1) * self.block <= end[:, None]) & (c < self.slots) & (c * self.block >= rel[:, None]),"
        " c, self.slots)",
        ("tests/test_compressed.py",),
    ),
    Mutation(
        "compressed memory: advance counts blocks the latest write only drafted",
        "specjax/cache/compressed.py",
        "        blocks = (new - self.start) // self.block\n",
        "        blocks = (new - self.start + self.slack) // self.block\n",
        ("tests/test_compressed.py",),
    ),
    Mutation(
        "compressed memory: rollback rewinds (clears) a committed memory slot",
        "specjax/cache/compressed.py",
        "            lengths=new, compressed=jnp.minimum(",
        "            mem_k=tuple(m.at[jnp.arange(self.batch), :, (new - self.start) // self.block - 1].set(0.0)"
        " for m in self.mem_k),\n            lengths=new, compressed=jnp.minimum(",
        ("tests/test_compressed.py",),
    ),
    Mutation(
        "compressed memory: rollback keeps counting memory slots of rejected tokens",
        "specjax/cache/compressed.py",
        "compressed=jnp.minimum(self.compressed, (new - self.start) // self.block),",
        "compressed=self.compressed,",
        ("tests/test_compressed.py",),
    ),
    Mutation(
        "compressed memory: a token counted both raw and in its memory slot",
        "specjax/cache/compressed.py",
        "ok_old = (old >= cut * self.block) & (old >= 0)",
        "ok_old = (old >= (cut - 1) * self.block) & (old >= 0)",
        ("tests/test_compressed.py",),
    ),
    Mutation(
        "compressed memory: a wide prefill keeps the write's last positions, not each row's own tail",
        "specjax/cache/compressed.py",
        "(q >= end[:, None] - self.size)",
        "(q >= rel[:, None] + t - self.size)",
        ("tests/test_compressed.py",),
    ),
    Mutation(
        "rolling ring: a wide prefill keeps the write's last positions, not each row's own tail",
        "specjax/cache/rolling.py",
        "        end = jnp.minimum(self.lengths + t, self.write_end)[:, None]\n",
        "        end = (self.lengths + t)[:, None]\n",
        ("tests/test_model.py",),
    ),
    Mutation(
        "capability check misses a counter shared by the whole batch",
        "specjax/cache/capability.py",
        "        if hasattr(x, \"dtype\") and np.ndim(x) == 0 and",
        "        if hasattr(x, \"dtype\") and np.ndim(x) == 7 and",
        ("tests/test_compressed.py",),
    ),
    # --- real checkpoints (#14) ---
    Mutation(
        "llama3 RoPE: low and high frequency factors swapped",
        "specjax/model/rope.py",
        "    low_wavelen = orig / np.float32(scaling.low_freq_factor)\n"
        "    high_wavelen = orig / np.float32(scaling.high_freq_factor)\n",
        "    low_wavelen = orig / np.float32(scaling.high_freq_factor)\n"
        "    high_wavelen = orig / np.float32(scaling.low_freq_factor)\n",
        ("tests/test_hf_families.py::test_rope_frequencies_match_transformers",),
    ),
    Mutation(
        "yarn RoPE: the attention factor dropped",
        "specjax/model/rope.py",
        "    return (interpolated * (1 - keep) + extrapolated * keep).astype(np.float32), attention\n",
        "    return (interpolated * (1 - keep) + extrapolated * keep).astype(np.float32), 1.0\n",
        ("tests/test_hf_families.py::test_rope_frequencies_match_transformers",),
    ),
    Mutation(
        "Gemma's (1 + w) RMSNorm applied as w",
        "specjax/model/llama.py",
        "    return (y * (w32 + offset if offset else w32)).astype(x.dtype)",
        "    return (y * w32).astype(x.dtype)",
        ("tests/test_hf_families.py::test_logits_match_transformers",),
    ),
    Mutation(
        "Gemma sliding_window_pattern off by one (layer i global when i % k == 0)",
        "specjax/hf.py",
        '"sliding_attention" if (i + 1) % k else "full_attention"',
        '"sliding_attention" if i % k else "full_attention"',
        ("tests/test_hf_families.py::test_logits_match_transformers",),
    ),
    Mutation(
        "Qwen3/Gemma q norm skipped",
        "specjax/model/llama.py",
        '        q, k = _norm(q, p["q_norm"], cfg), _norm(k, p["k_norm"], cfg)',
        '        q, k = q, _norm(k, p["k_norm"], cfg)',
        ("tests/test_hf_families.py::test_logits_match_transformers",),
    ),
    Mutation(
        "Gemma query_pre_attn_scalar ignored (head_dim ** -0.5 scale)",
        "specjax/model/llama.py",
        "    q = rope(q, positions, inv_freq, factor * q_scale)",
        "    q = rope(q, positions, inv_freq, factor)",
        ("tests/test_hf_families.py::test_logits_match_transformers",),
    ),
    Mutation(
        "an EOS list truncated to its first id when loaded",
        "specjax/hf.py",
        "(eos if isinstance(eos, list) else",
        "(eos[:1] if isinstance(eos, list) else",
        ("tests/test_hf_families.py::test_stop_ids_and_chat_template_as_transformers",),
    ),
    Mutation(
        "the engine stops only on a row's first stop id",
        "specjax/engine.py",
        "jnp.any(new_tok[:, :, None] == st.eos[:, None, :], axis=2)",
        "(new_tok == st.eos[:, :1])",
        ("tests/test_hf_families.py::test_eos_list_stops_on_any_id",),
    ),
    Mutation(
        "BOS prepended from the config whatever the tokenizer's post-processor does",
        "specjax/hf.py",
        "        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)",
        "        return [self.bos_id] * add_special_tokens"
        " + list(self.tokenizer.encode(text, add_special_tokens=False).ids)",
        ("tests/test_hf_families.py::test_tokenizer_parity_with_autotokenizer",),
    ),
    Mutation(
        "an MTP module attached to a model it was not trained for",
        "specjax/mtp_head.py",
        "    if differ:\n",
        "    if False:\n",
        ("tests/test_train_mtp.py::test_module_saved_elsewhere_is_passed_with_mtp_flag",),
    ),
    Mutation(
        "paged kernel: the host check of a concrete block table is staged into the caller's trace",
        "pallas_kernels/paged_attention.py",
        "        with jax.ensure_compile_time_eval():\n",
        "        if True:\n",
        ("tests/test_pallas_kernels.py",),
    ),
    # --- the layer scan: stacked params and per-layer cache stacks (#14 item 5) ---
    Mutation(
        "layer scan: a layer in a later period reads the params of the wrong layer",
        "specjax/model/llama.py",
        "layer_fn(x, carry, j, p * period + j, p * per[kinds[j]] + offset[j])",
        "layer_fn(x, carry, j, p + j, p * per[kinds[j]] + offset[j])",
        ("tests/test_model.py",),
    ),
    Mutation(
        "layer scan: every period writes and reads the first period's cache layers",
        "specjax/model/llama.py",
        "layer_fn(x, carry, j, p * period + j, p * per[kinds[j]] + offset[j])",
        "layer_fn(x, carry, j, p * period + j, offset[j])",
        ("tests/test_model.py",),
    ),
    Mutation(
        "stacked caches: every layer's write lands in layer 0 of the stack",
        "specjax/cache/base.py",
        "return buf.at[(layer, *idx)].set(",
        "return buf.at[(0, *idx)].set(",
        ("tests/test_model.py",),
    ),
    Mutation(
        "Pallas grid kernel: the dense/ring K/V block is read from layer 0 of the stack",
        "pallas_kernels/ragged_attention.py",
        "            return layer_ref[0], b, 0, clamp(j, lead_ref[b], qs_ref[b]), 0",
        "            return 0, b, 0, clamp(j, lead_ref[b], qs_ref[b]), 0",
        ("tests/test_pallas_kernels.py",),
    ),
    Mutation(
        "Pallas loop kernel: pages are read from layer 0 of the pool stack",
        "pallas_kernels/ragged_attention.py",
        "k, v = k_ref[layer, page, h], v_ref[layer, page, h]",
        "k, v = k_ref[0, page, h], v_ref[0, page, h]",
        ("tests/test_pallas_kernels.py",),
    ),
    Mutation(
        "CLI: --layer-loop scan leaves the model's layers listed (unrolled)",
        "specjax/cli.py",
        "        self.model = with_layer_loop(self.model, args.layer_loop)\n",
        "",
        ("tests/test_bundle.py::test_cli_generate_json_and_stream",),
    ),
    # --- load-adaptive depth: the simulator's policies (#16 item 2) ---
    Mutation(
        "depth policy: the acceptance estimate is never updated",
        "specjax/depth_policy.py",
        "    return jnp.where(revealed(proposed, accepted, est.shape[1]), (1.0 - r) * est + r * hit,\n",
        "    return jnp.where(revealed(proposed, accepted, est.shape[1]), est,\n",
        ("tests/test_depth_policy.py",),
    ),
    Mutation(
        "depth policy: goodput ignores the step cost",
        "specjax/depth_policy.py",
        "        rate = jnp.where(feasible, tokens / cost, -jnp.inf)",
        "        rate = jnp.where(feasible, tokens, -jnp.inf)",
        ("tests/test_depth_policy.py",),
    ),
    Mutation(
        "depth policy: rows with no chance of acceptance keep drafting",
        "specjax/depth_policy.py",
        "    base = _leading(reach(est) >= min_gain)  # [B]\n",
        "    base = jnp.full(live.shape, est.shape[1])\n",
        ("tests/test_depth_policy.py",),
    ),
    # --- depth="auto" in the engine ---
    Mutation(
        "auto depth: the engine never updates a row's acceptance estimate",
        "specjax/engine.py",
        "        est = jnp.where(active[:, None], update_estimates(est, told, told_a, pol.rate,",
        "        est = jnp.where(False, update_estimates(est, told, told_a, pol.rate,",
        ("tests/test_depth_auto.py::test_rows_whose_drafts_are_never_accepted_stop_drafting",),
    ),
    Mutation(
        "auto depth: the engine ignores the cost table",
        "specjax/engine.py",
        "    idx, drafts = choose(st.est, active, st.auto.cost, pol.rule,",
        "    idx, drafts = choose(st.est, active, placeholder_cost(eng, 1), pol.rule,",
        ("tests/test_depth_auto.py::test_the_cost_table_steers_the_window",),
    ),
    Mutation(
        "auto depth: the cost cache file is never read again once parsed (a rewrite goes unseen)",
        "specjax/depth_policy.py",
        "        seen = (str(path), (st.st_ino, st.st_mtime_ns, st.st_size))\n",
        "        seen = (str(path), ())\n",
        ("tests/test_depth_auto.py::test_the_measured_table_is_kept_on_disk_and_reused",),
    ),
    Mutation(
        "auto depth: the host-side cost reading ignores the load (the first batch's row)",
        "specjax/depth_policy.py",
        "np.interp(float(active), b, s[:, k])",
        "s[0, k]",
        ("tests/test_depth_policy.py::test_cost_table_interpolates_and_validates",),
    ),
    Mutation(
        "auto depth: the slowest row's lateness read one live row short (max_normal_table)",
        "specjax/depth_policy.py",
        "jnp.asarray(max_normal_table(live.shape[0]))[jnp.sum(live)]",
        "jnp.asarray(max_normal_table(live.shape[0]))[jnp.sum(live) - 1]",
        ("tests/test_depth_policy.py::test_makespan_counts_the_spread_of_the_slowest_row",),
    ),
    Mutation(
        "auto depth: the lateness table shifted by one count",
        "specjax/depth_policy.py",
        "[inv((n - 0.375) / (n + 0.25)) for n in range(2, size + 1)]",
        "[inv((n - 0.375) / (n + 0.25)) for n in range(3, size + 2)]",
        ("tests/test_depth_policy.py::test_expected_max_normal",),
    ),
    Mutation(
        "Pallas loop body: query rows not rounded to a power of two (Triton loads none other)",
        "pallas_kernels/_online_softmax.py",
        "    return max(16, 1 << (groups * t_q - 1).bit_length())\n",
        "    return max(16, groups * t_q)\n",
        ("tests/test_pallas_kernels.py::test_loop_body_lowers_for_gpu",),
    ),
    Mutation(
        "Pallas loop body: query rows stacked token-major (rows no longer group_queries' order)",
        "pallas_kernels/_online_softmax.py",
        "    x = q.reshape(b, t_q, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t_q, d)\n",
        "    x = q.reshape(b, t_q, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, g * t_q, d)\n",
        ("tests/test_pallas_kernels.py::test_query_rows_stack_per_kv_head_and_back",
         "tests/test_pallas_kernels.py::test_ragged_kernel_matches_reference"),
    ),
    Mutation(
        "rolling cache: the ring not aligned to RING_ALIGN slots (Triton blocks under 16 keys)",
        "specjax/model/llama.py",
        "        ring = -(-(config.sliding_window + reach) // RING_ALIGN) * RING_ALIGN\n",
        "        ring = config.sliding_window + reach\n",
        ("tests/test_pallas_kernels.py::test_engine_with_pallas_attention_lowers_for_gpu",),
    ),
    Mutation(
        "rolling cache: the ring kernel reads the whole ring as one block (not a power of two)",
        "specjax/cache/rolling.py",
        "                                  block_k=kernel_block(self.size))",
        "                                  block_k=self.size)",
        ("tests/test_pallas_kernels.py::test_engine_with_pallas_attention_lowers_for_gpu",),
    ),
    Mutation(
        "Pallas loop body leaves the GPU backend to jax_pallas_use_mosaic_gpu (no Triton params)",
        "pallas_kernels/ragged_attention.py",
        "        extra[\"compiler_params\"] = _TRITON_PARAMS()  # Triton's defaults; the body is written for it\n",
        "        pass\n",
        ("tests/test_pallas_kernels.py::test_loop_body_lowers_for_gpu",),
    ),
    Mutation(
        "auto depth, fill=False: each row's own draft count ignored (every row fills the window)",
        "specjax/engine.py",
        "proposed if eng.policy.fill else jnp.minimum(proposed, limit)",
        "proposed",
        ("tests/test_depth_auto.py::test_each_row_drafts_its_own_count",),
    ),
    Mutation(
        "greedy verify judges drafts past a row's draft count",
        "specjax/verify.py",
        "    tgt = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, w]\n    proposed = w - u if proposed is None "
        "else proposed\n",
        "    tgt = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, w]\n    proposed = w - u\n",
        ("tests/test_depth_auto.py::test_each_row_drafts_its_own_count",),
    ),
    Mutation(
        "rejection sampling judges drafts past a row's draft count",
        "specjax/verify.py",
        "    proposed = w - u if proposed is None else proposed\n    p_all",
        "    proposed = w - u\n    p_all",
        ("tests/test_depth_auto.py::test_each_row_drafts_its_own_count",),
    ),
    Mutation(
        "auto depth: a forced window (cost measurement) is ignored",
        "specjax/engine.py",
        "    return jnp.where(forced, jnp.maximum(at, narrowest), idx), jnp.where(forced, eng.depth, drafts), first\n",
        "    return idx, drafts, first\n",
        ("tests/test_depth_auto.py::test_a_forced_window_runs_with_every_row_drafting",),
    ),
    Mutation(
        "deferred MTP: a window-1 commit drops the target's hidden (the block later runs on stale input)",
        "specjax/drafter.py",
        ".set(hidden[:, 0], mode=\"drop\"),",
        ".set(dstate.pending[:, 0], mode=\"drop\"),",
        ("tests/test_depth_auto.py::test_mtp_deferred_over_window_1_equals_running_it_every_step",),
    ),
    Mutation(
        "deferred MTP: settle runs the block but never advances its cache",
        "specjax/drafter.py",
        "        return s.replace(cache=cache.advance(n), h=keep(h, s.h),",
        "        return s.replace(cache=cache, h=keep(h, s.h),",
        ("tests/test_depth_auto.py::test_mtp_deferred_over_window_1_equals_running_it_every_step",),
    ),
    Mutation(
        "deferred MTP: a drafting window runs without settling the backlog first (stale first draft)",
        "specjax/engine.py",
        "        return lambda s: chosen(s) & (drafter.backlog(s.dstate) > 0), chosen",
        "        return lambda s: chosen(s) & (drafter.backlog(s.dstate) < 0), chosen",
        ("tests/test_depth_auto.py::test_mtp_deferred_over_window_1_equals_running_it_every_step",),
    ),
    Mutation(
        "deferred MTP: a settle writes the backlog's whole width (past the target-sized block cache)",
        "specjax/model/llama.py",
        "        cache = cache.write(0, k, v, None if at is None else at + 1)",
        "        cache = cache.write(0, k, v)",
        ("tests/test_depth_auto.py::test_the_deferred_block_needs_no_room_past_the_targets_cache",
         "tests/test_model.py::test_mtp_block_at_one_slot_equals_that_slot_of_the_full_block"),
    ),
    Mutation(
        "row status: a write the drafter's own cache refused stays silent",
        "specjax/engine.py",
        "    return st.cache.status | eng.drafter.status(st.dstate)",
        "    return st.cache.status",
        ("tests/test_engine.py::test_a_write_the_drafters_own_cache_refused_is_an_error_not_silent",),
    ),
    Mutation(
        "row status: the draft model's cache reports no refused write",
        "specjax/drafter.py",
        "        return dstate.status\n",
        "        return jnp.zeros_like(dstate.lengths)\n",
        ("tests/test_engine.py::test_a_write_the_drafters_own_cache_refused_is_an_error_not_silent",),
    ),
    Mutation(
        "dense bounded write: the count is ignored past the capacity check (padding lands too)",
        "specjax/cache/dense.py",
        "        keep = fits[:, None] if count is None else fits[:, None] & (jnp.arange(t)[None] < count[:, None])",
        "        keep = fits[:, None]",
        ("tests/test_caches.py::test_a_bounded_write_needs_room_for_its_count_only",),
    ),
    Mutation(
        "optimistic: the upper bound never tightens however many verdicts the batch has had",
        "specjax/depth_policy.py",
        "    return jnp.clip(est + bonus * jnp.sqrt(est * (1.0 - est) / (n + 2.0)), 0.0, 1.0)",
        "    return jnp.clip(est + bonus * jnp.sqrt(est * (1.0 - est) / 2.0), 0.0, 1.0)",
        ("tests/test_depth_policy.py::test_optimistic_keeps_drafting_until_the_verdicts_are_firm",),
    ),
    Mutation(
        "optimistic: the verdicts counted per row, not over the batch",
        "specjax/depth_policy.py",
        "    n = jnp.sum(seen, axis=0, keepdims=True).astype(jnp.float32)  # [1, D]",
        "    n = seen.astype(jnp.float32)  # [1, D]",
        ("tests/test_depth_policy.py::test_optimistic_matches_a_reference",),
    ),
    Mutation(
        "auto depth: the step judges windows on the plain estimates (unlucky first verdicts stop it for good)",
        "specjax/engine.py",
        "                         seen=st.seen_pos, pool=pol.pool, upper=upper)",
        "                         seen=st.seen_pos, pool=pol.pool, upper=None)",
        ("tests/test_depth_auto.py::test_the_step_judges_windows_on_what_its_verdicts_support",),
    ),
    Mutation(
        "choose: the draft counts follow the upper bound (rows whose drafts keep failing never stop)",
        "specjax/depth_policy.py",
        "    base = _leading(reach(est) >= min_gain)  # [B]\n    est = est if upper is None else upper",
        "    est = est if upper is None else upper\n    base = _leading(reach(est) >= min_gain)  # [B]",
        ("tests/test_depth_policy.py::test_optimistic_keeps_drafting_until_the_verdicts_are_firm",),
    ),
    Mutation(
        "makespan pool: a row's first verdicts count as much as its hundredth",
        "specjax/depth_policy.py",
        "            own = own * n / (n + pool)",
        "            own = own * 1.0",
        ("tests/test_depth_policy.py::test_makespan_pools_rows_with_few_verdicts_towards_the_batch",),
    ),
    Mutation(
        "auto depth: the engine's makespan never sees the verdict counts (pool ignored)",
        "specjax/engine.py",
        "                         seen=st.seen_pos, pool=pol.pool, upper=upper)",
        "                         seen=None, pool=pol.pool, upper=upper)",
        ("tests/test_depth_auto.py::test_the_step_judges_windows_on_what_its_verdicts_support",),
    ),
    Mutation(
        "makespan: the batch's time summed over its rows, not set by its slowest row",
        "specjax/depth_policy.py",
        "                return jnp.max(jnp.where(live, left / mu, 0.0))",
        "                return jnp.sum(jnp.where(live, left / mu, 0.0))",
        ("tests/test_depth_policy.py::test_makespan_follows_the_row_that_finishes_last",),
    ),
    Mutation(
        "prior_weight ignored: a row's first verdicts move its estimate only by the EMA's rate",
        "specjax/depth_policy.py",
        "        r = jnp.maximum(rate, 1.0 / (prior_weight + 1.0 + n))\n",
        "        r = rate\n",
        ("tests/test_depth_policy.py::test_prior_weight_makes_the_first_verdicts_a_running_mean",),
    ),
    Mutation(
        "revealed: every proposed position counts as judged (past the first rejection too)",
        "specjax/depth_policy.py",
        "    return j < jnp.minimum(accepted + 1, proposed)[:, None]\n",
        "    return j < proposed[:, None]\n",
        ("tests/test_depth_policy.py::test_update_estimates_matches_numpy",),
    ),
    Mutation(
        "auto depth: the engine never counts a position's verdicts (seen_pos stays 0)",
        "specjax/engine.py",
        "        seen_pos=st.seen_pos + (revealed(told, told_a, dmax) & active[:, None]).astype(jnp.int32),\n",
        "        seen_pos=st.seen_pos,\n",
        ("tests/test_depth_auto.py::test_each_row_drafts_its_own_count",),
    ),
    Mutation(
        "auto depth: the choice is made once per loop, not after every step (a stale window)",
        "specjax/engine.py",
        "        return _pick(eng, _step_window(eng, params, st, eng.policy.windows[k], st.auto.drafts))\n",
        "        return _step_window(eng, params, st, eng.policy.windows[k], st.auto.drafts)\n",
        ("tests/test_depth_auto.py::test_rows_whose_drafts_are_never_accepted_stop_drafting",),
    ),
    Mutation(
        "cache write: a batch of one writing one token goes through the one-entry scatter (cache copies)",
        "specjax/cache/base.py",
        "    if len(idx) == 3 and isinstance(idx[1], slice) and np.size(idx[0]) == 1 and np.size(idx[2]) == 1:\n",
        "    if False:\n",
        ("tests/test_lean_step.py::test_one_row_one_token_writes_the_caches_in_place",),
    ),
    Mutation(
        "cache write: the spare entry of a one-entry write lands in range (overwrites the last slot)",
        "specjax/cache/base.py",
        "        spare = layer_spec(buf).shape[2]\n",
        "        spare = layer_spec(buf).shape[2] - 1\n",
        ("tests/test_caches.py::test_one_row_one_token_write_matches_numpy_and_drops_past_capacity",),
    ),
    Mutation(
        "makespan: each row's own noisy estimate, not pooled towards the batch mean",
        "specjax/depth_policy.py",
        "        pooled = own * est + (1.0 - own) * mean[None]\n",
        "        pooled = est\n",
        ("tests/test_depth_policy.py::test_makespan_follows_the_row_that_finishes_last",),
    ),
    Mutation(
        "makespan: spread=1 ignored (the makespan of expected steps)",
        "specjax/depth_policy.py",
        "            return jnp.max(jnp.where(live, left / mu + z * sd, 0.0))\n",
        "            return jnp.max(jnp.where(live, left / mu, 0.0))\n",
        ("tests/test_depth_policy.py::test_makespan_counts_the_spread_of_the_slowest_row",),
    ),
    Mutation(
        "yield variance: E[accepted^2] without the mean's square taken off",
        "specjax/depth_policy.py",
        "    return jnp.maximum(jnp.sum((2 * j + 1) * r, axis=1) - mean * mean, 0.0)\n",
        "    return jnp.maximum(jnp.sum((2 * j + 1) * r, axis=1), 0.0)\n",
        ("tests/test_depth_policy.py::test_yield_variance_matches_the_distribution",),
    ),
    Mutation(
        "makespan ignores the step cost",
        "specjax/depth_policy.py",
        "        rate = jnp.where(feasible, -steps * cost, -jnp.inf)",
        "        rate = jnp.where(feasible, -steps, -jnp.inf)",
        ("tests/test_depth_policy.py::test_makespan_follows_the_row_that_finishes_last",),
    ),
    Mutation(
        "auto depth: a static batch chooses by goodput (tokens of rows that finish early)",
        "specjax/validate.py",
        '"makespan" if static_batch else "goodput"',
        '"goodput"',
        ("tests/test_depth_auto.py::test_stream_and_batch_jobs_run_auto_depth",),
    ),
    # --- many devices (specjax.sharding, specjax.memory) ---
    Mutation(
        "mesh: a per-row state array left replicated where the table says data-sharded",
        "specjax/sharding.py",
        '    ("EngineState", "i"): P(),  # the step counter\n',
        '    ("EngineState", "i"): P(),  # the step counter\n    ("EngineState", "known"): P(),\n',
        ("tests/test_sharding.py::test_state_layout_on_one_mesh",),
    ),
    Mutation(
        "mesh: KV heads not replicated when n_kv_heads does not divide by the model axis",
        "specjax/sharding.py",
        "    if h % model == 0:\n        return h\n",
        "    if True:\n        return h\n",
        ("tests/test_sharding.py::test_sharded_layout_keeps_the_model",),
    ),
    Mutation(
        "mesh: replicated KV heads copied from the wrong source heads",
        "specjax/sharding.py",
        "    rep = np.arange(hkv2) * hkv // hkv2",
        "    rep = np.arange(hkv2) % hkv",
        ("tests/test_sharding.py::test_sharded_layout_keeps_the_model",),
    ),
    Mutation(
        "many processes: a process reads its rows from the wrong data slots",
        "specjax/sharding.py",
        "    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)\n",
        "    shards = sorted(x.addressable_shards, key=lambda s: -(s.index[0].start or 0))\n",
        ("tests/test_sharding.py::test_two_processes_each_get_their_own_rows",),
    ),
    Mutation(
        "generate brings the caches back to the host",
        "specjax/engine.py",
        "    small = st.replace(cache=None, dstate=None)\n",
        "    small = st\n",
        ("tests/test_sharding.py::test_generate_brings_back_no_cache",),
    ),
    Mutation(
        "memory plan: a sharded array counted whole on every device",
        "specjax/memory.py",
        "        total += int(np.prod(x.shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize // split\n",
        "        total += int(np.prod(x.shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize\n",
        ("tests/test_cli.py::test_memory_sizes_a_llama3_8b_shaped_config_on_a_v5e8_shaped_mesh",),
    ),
    Mutation(
        "mesh: the paged pool left whole on every data shard (one pool per shard in the table)",
        "specjax/sharding.py",
        '    ("PagedKVCache", "k"): P(DATA, MODEL, None, None),',
        '    ("PagedKVCache", "k"): P(None, MODEL, None, None),',
        ("tests/test_sharding.py::test_a_paged_pool_is_split_over_the_data_shards",
         "tests/test_sharding.py::test_state_layout_on_one_mesh"),
    ),
    Mutation(
        "mesh: the engine never splits the paged pool per data shard",
        "specjax/engine.py",
        '        if self.pool_groups > 1 and hasattr(cache, "split_pool"):',
        '        if False and hasattr(cache, "split_pool"):',
        ("tests/test_sharding.py::test_a_paged_pool_is_split_over_the_data_shards",
         "tests/test_sharding.py::test_state_layout_on_one_mesh"),
    ),
    Mutation(
        "pool groups: every group's rows write into group 0's pages",
        "specjax/cache/paged.py",
        "        return jnp.where(self.block_table >= 0, self.block_table + base[:, None], -1)\n",
        "        return self.block_table\n",
        ("tests/test_caches.py::test_a_pool_split_in_groups_is_its_groups_pools_side_by_side",),
    ),
    Mutation(
        "pool groups: a refill row listed in another group's block is not flagged",
        "specjax/cache/paged.py",
        "            status = jnp.where(wrong, POOL_GROUP_MISMATCH, 0)\n",
        "            status = jnp.where(wrong, 0, 0)\n",
        ("tests/test_caches.py::test_rows_view_flags_a_row_listed_in_another_groups_block",),
    ),
    Mutation(
        "pool groups: admission budgets the whole pool, not the group's share",
        "specjax/batch.py",
        "    share = None if pool is None else pool // groups\n",
        "    share = pool\n",
        ("tests/test_batch.py::test_admits_fill_each_slot_group_from_its_own_pool",
         "tests/test_batch.py::test_slot_groups_with_their_own_pools_give_every_request_its_alone_tokens"),
    ),
    # --- bring your own model or drafter (specjax.protocols, specjax.nnx_adapter) ---
    Mutation(
        "nnx adapter: K/V written at the batch's shared offset instead of each row's own",
        "specjax/nnx_adapter.py",
        "            c = glob[0].write(layer, k.astype(self.dtype), v.astype(self.dtype))  # at each row's own offset"
        "\n",
        "            own = glob[0].lengths\n"
        "            c = glob[0].replace(lengths=jnp.full_like(own, jnp.max(own)))\n"
        "            c = c.write(layer, k.astype(self.dtype), v.astype(self.dtype)).replace(lengths=own)\n",
        ("tests/test_plugins.py::test_nnx_decoder_speculates_its_own_greedy_tokens",),
    ),
    Mutation(
        "nnx adapter: the decoder compared by identity (a rebuilt graph definition recompiles)",
        "specjax/nnx_adapter.py",
        "@dataclasses.dataclass(frozen=True)\nclass NnxDecoder:",
        "@dataclasses.dataclass(frozen=True, eq=False)\nclass NnxDecoder:",
        ("tests/test_plugins.py::test_wrapping_again_is_no_recompile",),
    ),
    Mutation(
        "user drafter: its commit never called (the state never learns)",
        "specjax/drafter.py",
        "        return dstate if commit is None else commit(self.context(eng, st), dstate, a)\n",
        "        return dstate\n",
        ("tests/test_plugins.py::test_a_drafter_of_your_own_is_lossless_and_used",),
    ),
    Mutation(
        "user drafter: a refilled slot keeps the previous request's state",
        "specjax/drafter.py",
        "        return jax.tree.map(lambda big, small: big.at[rows].set(small.astype(big.dtype), mode=\"drop\"), "
        "dstate, sub)\n",
        "        return dstate\n",
        ("tests/test_plugins.py::test_a_drafters_state_follows_slot_refill",),
    ),
    Mutation(
        "engine: the target's logits taken from the draft model's decoder",
        "specjax/engine.py",
        "    logits = eng.target.head(params[\"target\"], hidden)  # [B, w, V]\n",
        "    logits = (eng.draft or eng.target).head(params[\"draft\" if eng.draft else \"target\"], hidden)\n",
        ("tests/test_plugins.py::test_nnx_decoder_speculates_its_own_greedy_tokens",),
    ),
    Mutation(
        "ngram auto: a row offers drafts without a match",
        "specjax/engine.py",
        "        proposed = jnp.minimum(proposed, eng.drafter.available(eng, st))\n",
        "        proposed = proposed\n",
        ("tests/test_depth_auto.py::test_ngram_rows_without_a_match_offer_no_drafts",),
    ),
    Mutation(
        "ngram auto: the match skipped at window 2 as well as window 1",
        "specjax/engine.py",
        "if limit is not None and w > 1 and hasattr(",
        "if limit is not None and w > 2 and hasattr(",
        ("tests/test_depth_auto.py::test_ngram_rows_without_a_match_offer_no_drafts",),
    ),
    Mutation(
        "simulate --policy auto: the simulator's knobs instead of the engine's",
        "specjax/cli.py",
        "knobs = DepthPolicy.auto(table.windows[-1] - 1, policy, always_offers=args.match is None).knobs()",
        "knobs = {}",
        ("tests/test_depth_policy.py::test_cli_simulate_auto_models_the_engine",),
    ),
    Mutation(
        "simulate --policy auto --match: an MTP run's knobs for n-gram rows",
        "specjax/cli.py",
        "knobs = DepthPolicy.auto(table.windows[-1] - 1, policy, always_offers=args.match is None).knobs()",
        "knobs = DepthPolicy.auto(table.windows[-1] - 1, policy, always_offers=True).knobs()",
        ("tests/test_depth_policy.py::test_cli_simulate_auto_models_an_ngram_run_with_match",),
    ),
    Mutation(
        "depth='auto': MTP / draft model estimates drift as slowly as n-gram's (the window-1 lock-in)",
        "specjax/validate.py",
        'always_offers=drafter_kind(drafter) != "ngram")',
        "always_offers=False)",
        ("tests/test_depth_auto.py::test_auto_estimates_drift_faster_for_drafters_that_offer_every_draft",),
    ),
    Mutation(
        "depth='auto': n-gram estimates drift back to the prior as fast as MTP's",
        "specjax/validate.py",
        'always_offers=drafter_kind(drafter) != "ngram")',
        "always_offers=True)",
        ("tests/test_depth_auto.py::test_auto_estimates_drift_faster_for_drafters_that_offer_every_draft",),
    ),
    Mutation(
        "DepthPolicy.auto: always_offers ignored (the slow drift for every drafter)",
        "specjax/depth_policy.py",
        "relax_early=RELAX_EARLY if always_offers else 0.0,",
        "relax_early=0.0,",
        ("tests/test_depth_policy.py::test_a_row_whose_first_drafts_fail_drafts_again_when_its_drafter_offers_every_draft",),
    ),
    Mutation(
        "attention 'auto': Pallas on GPU again (the kernels do not lower through Triton)",
        "specjax/cache/base.py",
        'return "pallas" if jax.default_backend() == "tpu" else "xla"',
        'return "xla" if jax.default_backend() == "cpu" else "pallas"',
        ("tests/test_lean_step.py::test_auto_attention_is_pallas_on_tpu_only",),
    ),
    Mutation(
        "DepthPolicy.auto: n-gram's makespan ignores the slowest row's lateness (spread 0: the batch's tail unseen)",
        "specjax/depth_policy.py",
        "spread=0.0 if always_offers else 1.0)",
        "spread=0.0)",
        ("tests/test_depth_policy.py::test_ngram_auto_counts_the_lateness_of_the_slowest_row",
         "tests/test_depth_auto.py::test_auto_estimates_drift_faster_for_drafters_that_offer_every_draft"),
    ),
    Mutation(
        "auto depth: the engine's estimates ignore relax_early (the window-1 lock-in again)",
        "specjax/engine.py",
        "st.seen_pos, pol.prior_weight, pol.relax_early), est)",
        "st.seen_pos, pol.prior_weight), est)",
        ("tests/test_depth_auto.py::test_a_row_at_window_1_forgets_an_estimate_resting_on_few_verdicts",),
    ),
    Mutation(
        "relax_early never fades (a row whose drafts keep failing drifts back fast too)",
        "specjax/depth_policy.py",
        "relax_early * jnp.clip(1.0 - n / EARLY_VERDICTS, 0.0, 1.0)",
        "relax_early",
        ("tests/test_depth_policy.py::test_update_estimates_matches_numpy",
         "tests/test_depth_auto.py::test_a_row_at_window_1_forgets_an_estimate_resting_on_few_verdicts",
         "tests/test_depth_auto.py::test_rows_whose_drafts_are_never_accepted_stop_drafting"),
    ),
    Mutation(
        "ngram auto: the window not narrowed to the drafts the rows can offer",
        "specjax/engine.py",
        "        idx = jnp.minimum(idx, jnp.argmax(windows >= holds)).astype(jnp.int32)",
        "        idx = idx.astype(jnp.int32)",
        ("tests/test_depth_auto.py::test_ngram_rows_without_a_match_offer_no_drafts",),
    ),
    Mutation(
        "ngram auto: the estimates learn only from the drafts offered",
        "specjax/engine.py",
        "    told, told_a = intended, a\n",
        "    told, told_a = proposed, a\n",
        ("tests/test_depth_auto.py::test_ngram_rows_without_a_match_offer_no_drafts",),
    ),
    Mutation(
        "ngram available: one draft more than the match holds",
        "specjax/drafter.py",
        "jnp.clip(st.known - best - self.n, 0, eng.depth)",
        "jnp.clip(st.known - best - self.n + 1, 0, eng.depth)",
        ("tests/test_depth_auto.py::test_ngram_offer_matches_a_reference",),
    ),
    Mutation(
        "ngram offer: the first draft one token past the match's continuation",
        "specjax/drafter.py",
        "_gather(st.seq, (best + self.n)[:, None])[:, 0]",
        "_gather(st.seq, (best + self.n + 1)[:, None])[:, 0]",
        ("tests/test_depth_auto.py::test_ngram_offer_matches_a_reference",),
    ),
    Mutation(
        "ngram auto: rows without a match get no window-1 verdict (estimates conditioned on a match)",
        "specjax/engine.py",
        "        told, told_a = jnp.ones_like(a), hit.astype(jnp.int32)\n",
        "        told, told_a = (st.auto.first >= 0).astype(jnp.int32), hit.astype(jnp.int32)\n",
        ("tests/test_depth_auto.py::test_a_window_1_step_judges_an_ngram_rows_first_draft_for_free",),
    ),
    Mutation(
        "ngram auto: the window-1 verdict ignores the target's token (every matched draft accepted)",
        "specjax/engine.py",
        "hit = (st.auto.first >= 0) & (st.auto.first == nxt)",
        "hit = st.auto.first >= 0",
        ("tests/test_depth_auto.py::test_a_window_1_step_judges_an_ngram_rows_first_draft_for_free",),
    ),
    Mutation(
        "ngram auto: no window-1 verdict (the estimates learn only while drafting)",
        "specjax/engine.py",
        "if limit is not None and w == 1 and hasattr(eng.drafter, \"offer\"):",
        "if False:",
        ("tests/test_depth_auto.py::test_a_window_1_step_judges_an_ngram_rows_first_draft_for_free",),
    ),
    Mutation(
        "ngram auto: the window-1 verdict counted as a proposed draft",
        "specjax/engine.py",
        "prop_pos=st.prop_pos + ((kd < intended[:, None])",
        "prop_pos=st.prop_pos + ((kd < told[:, None])",
        ("tests/test_depth_auto.py::test_a_window_1_step_judges_an_ngram_rows_first_draft_for_free",),
    ),
    Mutation(
        "ngram auto: the first draft not kept for the next step",
        "specjax/engine.py",
        "auto=st.auto.replace(pick=idx, drafts=drafts, first=first))",
        "auto=st.auto.replace(pick=idx, drafts=drafts))",
        ("tests/test_depth_auto.py::test_a_window_1_step_judges_an_ngram_rows_first_draft_for_free",),
    ),
    Mutation(
        "cost measurement: the windows in the same order every round",
        "specjax/engine.py",
        "        for c in calls[r % len(calls):] + calls[:r % len(calls)]:\n",
        "        for c in calls:\n",
        ("tests/test_depth_auto.py::test_the_cost_measurement_interleaves_windows_and_keeps_each_ones_fastest",),
    ),
    Mutation(
        "cost measurement: each window keeps its slowest run",
        "specjax/engine.py",
        "best[c], taken[c] = min(best[c], s), max(taken[c], n)",
        "best[c], taken[c] = (s if best[c] == np.inf else max(best[c], s)), max(taken[c], n)",
        ("tests/test_depth_auto.py::test_the_cost_measurement_interleaves_windows_and_keeps_each_ones_fastest",),
    ),
    Mutation(
        "cost table: noise flattened upward (one slow window prices every wider one at its figure)",
        "specjax/engine.py",
        "    return np.maximum(np.concatenate([s[:1], np.minimum.accumulate(s[:0:-1])[::-1]]), s[0])\n",
        "    return np.maximum.accumulate(s)\n",
        ("tests/test_depth_auto.py::test_a_drafting_window_slow_in_every_round_takes_a_wider_ones_figure",),
    ),
    Mutation(
        "cost table: a drafting window priced under plain decoding",
        "specjax/engine.py",
        "    return np.maximum(np.concatenate([s[:1], np.minimum.accumulate(s[:0:-1])[::-1]]), s[0])\n",
        "    return np.concatenate([s[:1], np.minimum.accumulate(s[:0:-1])[::-1]])\n",
        ("tests/test_depth_auto.py::test_a_drafting_window_slow_in_every_round_takes_a_wider_ones_figure",),
    ),
    Mutation(
        "sim Matches: the window not narrowed to the drafts rows offer",
        "specjax/sim.py",
        "        if offers:  # as ``engine._choice``",
        "        if False:  # as ``engine._choice``",
        ("tests/test_sim.py",),
    ),
    Mutation(
        "sim Matches: no window-1 verdict on a matched row's first draft",
        "specjax/sim.py",
        "        if offers:\n            one = windows[idx] == 1\n",
        "        if False:\n            one = windows[idx] == 1\n",
        ("tests/test_sim.py",),
    ),
    Mutation(
        "sim Matches: runs ignored (a match as likely to last as to start)",
        "specjax/sim.py",
        "stay = jnp.where(q < 1, 1 - 1 / burst, 1.0)",
        "stay = jnp.where(q < 1, jnp.minimum(q / jnp.maximum(1 - q, 1e-9) / burst, 1.0), 1.0)",
        ("tests/test_sim.py",),
    ),
    Mutation(
        "sim Matches: rows without a match still draft at a fixed depth",
        "specjax/sim.py",
        "proposed = jnp.where(m, window - u, 0)",
        "proposed = window - u",
        ("tests/test_sim.py",),
    ),
    Mutation(
        "sim Matches: match streams keyed by batch slot, not row id",
        "specjax/sim.py",
        "keys = jax.vmap(lambda r: jax.random.fold_in(base, r))(row_ids)",
        "keys = jax.vmap(lambda r: jax.random.fold_in(base, r))(jnp.arange(row_ids.shape[0]))",
        ("tests/test_sim.py",),
    ),
    Mutation(
        "depth='auto' fill ignored: rows propose only their own count in a wider window",
        "specjax/engine.py",
        "proposed if eng.policy.fill else jnp.minimum(proposed, limit)",
        "jnp.minimum(proposed, limit)",
        ("tests/test_depth_auto.py",),
    ),
    Mutation(
        "makespan ties go to the narrowest window, not the one emitting the most tokens",
        "specjax/depth_policy.py",
        "rate = jnp.where(rate >= jnp.max(rate) * (1.0 + 1e-6), tokens / cost, -jnp.inf)",
        "rate = rate",
        ("tests/test_depth_policy.py",),
    ),
    Mutation(
        "sim fill ignored: rows propose only their own count in a wider window",
        "specjax/sim.py",
        "drafts = room if fill else jnp.minimum(drafts, room)",
        "drafts = jnp.minimum(drafts, room)",
        ("tests/test_sim.py",),
    ),
    Mutation(
        "sim Trace.from_rows(steps=) pads rows with rejections instead of repeating their own steps",
        "specjax/sim.py",
        "np.resize(np.asarray(t, np.int32), steps)",
        "np.pad(np.asarray(t, np.int32)[:steps], (0, max(steps - len(t), 0)))",
        ("tests/test_sim.py::test_trace_from_recorded_rows",),
    ),
    Mutation(
        "sim Trace refuses a deeper run's prefixes (no replay at a shallower window)",
        "specjax/sim.py",
        "        if (arr < 0).any():",
        "        if (arr < 0).any() or (arr > depth).any():",
        ("tests/test_sim.py::test_a_deeper_trace_replays_at_a_shallower_depth",),
    ),
    Mutation(
        "bench keeps each row's last pass, not its fastest",
        "specjax/bench.py",
        "    fastest = {c: min(per_round[c]) for c in configs}",
        "    fastest = {c: per_round[c][-1] for c in configs}",
        ("tests/test_bundle.py::test_the_bench_keeps_each_rows_fastest_pass",),
    ),
    Mutation(
        "bench recipe_pick ignores shift (the policy_traces 'recipe' set is the bench's own prompts)",
        "specjax/bench.py",
        "cands[int((i + shift) * step)]",
        "cands[int(i * step)]",
        ("tests/test_bundle.py::test_the_bench_recipe_picks_evenly_and_a_shift_picks_none_of_the_same",),
    ),
    Mutation(
        "an n-gram batch drafts from its prior on its first step instead of looking at window 1 (free verdicts)",
        "specjax/engine.py",
        "        idx = jnp.where(fresh, narrowest, idx).astype(jnp.int32)",
        "        idx = idx.astype(jnp.int32)",
        ("tests/test_depth_auto.py::test_an_ngram_batch_looks_before_drafting",),
    ),
    Mutation(
        "sim: an n-gram batch drafts from its prior on its first step (the engine looks at window 1 first)",
        "specjax/sim.py",
        "            idx = jnp.where(fresh, jnp.argmax(windows >= need), idx)",
        "            idx = jnp.where(False, jnp.argmax(windows >= need), idx)",
        ("tests/test_depth_policy.py::test_the_simulated_ngram_batch_looks_before_drafting",),
    ),
    Mutation(
        "depth='auto' ignores the table's acceptance (every position starts at DepthPolicy.prior)",
        "specjax/depth_policy.py",
        "self.acceptance if self.acceptance is not None else [default] * d",
        "[default] * d",
        ("tests/test_depth_auto.py::test_a_tables_acceptance_is_where_the_estimates_start_and_drift_back_to",),
    ),
    Mutation(
        "depth='auto' estimates drift back to DepthPolicy.prior, not the table's acceptance",
        "specjax/engine.py",
        "update_estimates(est, told, told_a, pol.rate, st.auto.prior, pol.relax,",
        "update_estimates(est, told, told_a, pol.rate, pol.prior, pol.relax,",
        ("tests/test_depth_auto.py::test_a_tables_acceptance_is_where_the_estimates_start_and_drift_back_to",),
    ),
    Mutation(
        "a refilled row keeps DepthPolicy.prior, not the table's acceptance",
        "specjax/batch.py",
        "        sub = with_auto(sub, st.auto)",
        "        pass",
        ("tests/test_batch.py::test_a_refilled_row_starts_at_the_tables_acceptance",),
    ),
    # --- controlled acceptance, the at-scale bench, MTP draft vocabularies ---
    Mutation(
        "scale: the roofline keeps XLA's gather bytes (a whole embedding per token lookup)",
        "specjax/scale.py",
        "    nbytes = max(raw - over, 0.0)",
        "    nbytes = raw",
        ("tests/test_controlled.py::test_bench_shape_reports_every_row_at_a_known_acceptance",),
    ),
    Mutation(
        'controlled: a wrong draft is the right token (every draft accepted)',
        'specjax/controlled.py',
        '        wrong = (right + 1 + jnp.abs(drafts) % max(v - 1, 1)) % v',
        '        wrong = right + 0 * drafts',
        ('tests/test_controlled.py::test_all_right_accepts_every_draft_and_all_wrong_none',),
    ),
    Mutation(
        'controlled: a wrong draft no longer depends on the real drafter (XLA drops the MTP chain)',
        'specjax/controlled.py',
        '        wrong = (right + 1 + jnp.abs(drafts) % max(v - 1, 1)) % v',
        '        wrong = (right + 1) % v',
        ('tests/test_controlled.py::test_the_real_drafters_work_stays_in_the_step',),
    ),
    Mutation(
        'controlled: the rates are ignored (every draft a coin flip)',
        'specjax/controlled.py',
        '        ok = _uniform(st.seeds, pos, k) < rates[None]',
        '        ok = _uniform(st.seeds, pos, k) < 0.5',
        ('tests/test_controlled.py::test_conditional_acceptance_follows_the_rates',),
    ),
    Mutation(
        'controlled: a replayed trace is ignored',
        'specjax/controlled.py',
        '        ok = jnp.where(planned >= 0, k < planned, ok)',
        '        ok = jnp.where(planned >= 0, ok, ok)',
        ('tests/test_controlled.py::test_a_replayed_trace_is_accepted_step_by_step',),
    ),
    Mutation(
        'controlled: a trace past its end repeats its last count (not the rates)',
        'specjax/controlled.py',
        '        planned = jnp.where(s < data.trace.shape[1], _gather(data.trace, s), -1)',
        '        planned = _gather(data.trace, s)',
        ('tests/test_controlled.py::test_a_replayed_trace_is_accepted_step_by_step',),
    ),
    Mutation(
        "controlled: draws keyed by the row's slot, not its seed",
        'specjax/controlled.py',
        '        ok = _uniform(st.seeds, pos, k) < rates[None]',
        '        ok = _uniform(jnp.arange(st.seeds.shape[0]), pos, k) < rates[None]',
        ('tests/test_controlled.py::test_a_row_alone_accepts_what_it_accepts_in_a_batch',),
    ),
    Mutation(
        'scale: efficiency leaves out the tokens per step',
        'specjax/scale.py',
        '"efficiency": (tps / plain_tps) / (m["tok_per_step"] * plain_ms / fwd[w]),',
        '"efficiency": (tps / plain_tps) / (plain_ms / fwd[w]),',
        ('tests/test_controlled.py::test_bench_shape_reports_every_row_at_a_known_acceptance',),
    ),
    Mutation(
        'draft vocabulary: a draft index is not mapped to its target token',
        'specjax/drafter.py',
        '    return ids[tok], p\n',
        '    return tok, p\n',
        ('tests/test_draft_vocab.py::test_a_token_outside_the_draft_vocabulary_is_never_drafted',),
    ),
    Mutation(
        'draft vocabulary: the sampled draft distribution is not scattered to its ids',
        'specjax/drafter.py',
        '        p = jnp.zeros((p.shape[0], dec.vocab_size), p.dtype).at[:, ids].set(p)',
        '        p = jnp.zeros((p.shape[0], dec.vocab_size), p.dtype).at[:, : ids.shape[0]].set(p)',
        ('tests/test_draft_vocab.py::test_sampled_mtp_with_a_draft_vocabulary_matches_the_target_distribution',),
    ),
    Mutation(
        'draft vocabulary: the MTP head runs over the whole vocabulary (no saving)',
        'specjax/model/llama.py',
        '    if not cfg.mtp_draft_vocab:\n        return head(params, cfg, x)',
        '    if True:\n        return head(params, cfg, x)[..., : params["mtp"]["draft_ids"].shape[0]]',
        ('tests/test_draft_vocab.py::test_the_mtp_step_pays_the_head_over_the_draft_vocabulary_only',),
    ),
    Mutation(
        "draft vocabulary: load_mtp casts the ids to the weights' dtype",
        'specjax/mtp_head.py',
        '            want_dtype = np.int32 if name.endswith("draft_ids") else dtype',
        '            want_dtype = dtype',
        ('tests/test_draft_vocab.py::test_save_and_load_keep_the_ids_exact_in_bfloat16',),
    ),
    Mutation(
        'draft vocabulary: training labels are not mapped into it',
        'specjax/train.py',
        '    return jnp.where(labels >= 0, index[jnp.clip(labels, 0, config.vocab_size - 1)], -1)',
        '    return labels',
        ('tests/test_draft_vocab.py::test_draft_labels_map_into_the_vocabulary',),
    ),
]


def copy_tree(dest: Path, name: str = "tree") -> Path:
    """The checkout without its virtualenv, git data and caches: where mutations happen."""
    ignore = shutil.ignore_patterns(".venv", ".git", "__pycache__", ".pytest_cache", ".ruff_cache", "runs",
                                    ".hypothesis")
    return Path(shutil.copytree(ROOT, dest / name, ignore=ignore))


def run_one(m: Mutation, python: str, root: Path = ROOT) -> dict:
    path = root / m.path
    src = path.read_text()
    count = src.count(m.old)
    if count != 1:
        return {"name": m.name, "status": "stale", "detail": f"snippet found {count} times in {m.path}"}
    t0 = time.time()
    try:
        path.write_text(src.replace(m.old, m.new))
        proc = subprocess.run(
            [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests],
            cwd=root,
            capture_output=True,
            text=True,
            env=os.environ | {"HYPOTHESIS_PROFILE": "ci"},
        )
    finally:
        path.write_text(src)
    caught = proc.returncode != 0
    tail = (proc.stdout.strip().splitlines() or [""])[-1]
    return {
        "name": m.name,
        "status": "caught" if caught else "missed",
        "seconds": round(time.time() - t0, 1),
        "detail": tail,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", default="", help="only mutations whose name contains this")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("-j", "--jobs", type=int, default=min(8, os.cpu_count() or 1),
                    help="mutations run at once, each in its own copy of the tree (default: cores, at most 8)")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        print(f"mutation_check: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    selected = [m for m in MUTATIONS if args.k in m.name]
    if args.list:
        for m in selected:
            print(f"{m.name}  [{m.path}]")
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="specjax-mutations-"))
    trees: queue.Queue[Path] = queue.Queue()
    try:
        for k in range(min(args.jobs, len(selected)) or 1):
            trees.put(copy_tree(scratch, f"tree{k}"))

        def one(m: Mutation) -> dict:
            root = trees.get()  # a tree no other job is editing
            try:
                return _report(run_one(m, sys.executable, root), args.json)
            finally:
                trees.put(root)

        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(one, selected))  # reported as they finish, returned in list order
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    bad = [r for r in results if r["status"] != "caught"]
    if args.json:
        print(json.dumps({"results": results, "missed": len(bad)}))
    else:
        print(f"{len(results) - len(bad)}/{len(results)} mutations caught")
    return 1 if bad else 0


def _report(r: dict, quiet: bool) -> dict:
    if not quiet:
        print(f"{r['status']:>7}  {r['name']}  ({r.get('seconds', 0)}s; {r['detail']})", flush=True)
    return r


if __name__ == "__main__":
    raise SystemExit(main())
