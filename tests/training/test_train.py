"""Tokenizer, corpus, training stages (smoke), resume, MTP chain training vs inference."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from specjax.cache import DenseKVCache
from specjax.corpus import EXCLUDED_DIRS, build_corpus, is_held_out, stdlib_files
from specjax.model import ModelConfig, init_model
from specjax.model.llama import hidden_states, mtp_forward
from specjax.tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE, ByteTokenizer
from specjax.train import batch_for_step, mtp_chain_logits, n_windows, preset, run_stage

TOK = ByteTokenizer()


# ----------------------------------------------------------------------------- tokenizer


@given(st.text())
def test_tokenizer_round_trips_text(s):
    ids = TOK.encode(s)
    assert all(0 <= i < 256 for i in ids)
    assert TOK.decode(ids) == s
    assert TOK.decode(TOK.encode(s, bos=True, eos=True)) == s


@given(st.binary())
def test_tokenizer_round_trips_bytes(b):
    assert TOK.decode_bytes(TOK.encode(b)) == b
    # undecodable bytes survive as text too (surrogateescape)
    assert TOK.decode(TOK.encode(b)).encode("utf-8", "surrogateescape") == b


def test_tokenizer_specials():
    ids = TOK.encode("ab", bos=True, eos=True)
    assert ids == [BOS_ID, 97, 98, EOS_ID]
    assert TOK.decode([97, EOS_ID, 98]) == "a"  # stops at EOS
    assert TOK.decode([97, EOS_ID, 98], stop_at_eos=False) == "ab"
    with pytest.raises(ValueError, match="token id 259"):
        TOK.decode([VOCAB_SIZE])


# ----------------------------------------------------------------------------- corpus


def test_corpus_files_sorted_without_tests():
    files = stdlib_files()
    rels = [r for r, _ in files]
    assert rels == sorted(rels) and len(rels) > 100
    assert not any(EXCLUDED_DIRS.intersection(r.split("/")[:-1]) for r in rels)
    held = [r for r in rels if is_held_out(r)]
    assert 0 < len(held) < len(rels) // 10


def test_corpus_streams_are_documents_and_split_by_file():
    c = build_corpus(max_files=40)
    assert set(c.train_files).isdisjoint(c.held_out_files)
    for stream, files in ((c.train, c.train_files), (c.held_out, c.held_out_files)):
        assert (stream == BOS_ID).sum() == len(files) == (stream == EOS_ID).sum()
        assert stream[0] == BOS_ID and stream[-1] == EOS_ID
    assert build_corpus(max_files=40).fingerprint() == c.fingerprint()


def test_batches_are_a_pure_function_of_step_and_cover_each_epoch():
    stream = np.arange(1000, dtype=np.int32)
    seq, b = 10, 3
    n = n_windows(stream, seq)
    a = batch_for_step(stream, seq, b, 5, seed=1)
    np.testing.assert_array_equal(a, batch_for_step(stream, seq, b, 5, seed=1))
    assert not np.array_equal(a, batch_for_step(stream, seq, b, 5, seed=2))
    starts = np.concatenate([batch_for_step(stream, seq, b, s, 1)[:, 0] for s in range(n // b)])
    assert len(set(starts.tolist())) == len(starts)  # no window twice within an epoch
    w = batch_for_step(stream, seq, b, 0, 1)
    np.testing.assert_array_equal(w[:, 1:] - w[:, :-1], 1)  # contiguous windows of seq + 1


# ----------------------------------------------------------------------------- MTP training = MTP drafting


def test_mtp_chain_logits_match_the_cached_drafter_chain():
    """Pass k at row p of the training chain equals what MtpDrafter computes at draft k
    (cached ``mtp_forward``: pass 1 over the committed prefix, then chained single tokens)."""
    cfg = ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=32)
    m = init_model(cfg, seed=3)
    depth, t = 3, 12
    tokens = jax.random.randint(jax.random.key(0), (2, t + depth), 0, 40)
    _, hidden = hidden_states(m, tokens[:, :t])
    chain = mtp_chain_logits(m.params, cfg, hidden, tokens, depth)
    for p in (0, 5, t - 1):
        cache = DenseKVCache.create(1, 2, 32, cfg.n_kv_heads, cfg.head_dim)
        pos = jnp.broadcast_to(jnp.arange(p + 1), (2, p + 1))
        lg, g, cache = mtp_forward(m.params, cfg, hidden[:, : p + 1], tokens[:, 1 : p + 2], pos, cache)
        np.testing.assert_allclose(lg[:, p], chain[0][:, p], atol=2e-5)
        cache = cache.advance(p + 1)
        h = g[:, p : p + 1]
        for k in range(2, depth + 1):
            at = jnp.full((2,), p + k - 1, jnp.int32)
            lg, g, cache = mtp_forward(m.params, cfg, h, tokens[:, p + k : p + k + 1], at[:, None],
                                       cache.replace(lengths=at))
            np.testing.assert_allclose(lg[:, 0], chain[k - 1][:, p], atol=2e-5)
            h = g


# ----------------------------------------------------------------------------- stages, checkpoints, resume


@pytest.fixture(scope="module")
def smoke():
    recipe = preset("smoke")
    return recipe, build_corpus(max_files=recipe.max_files)


@pytest.mark.parametrize("stage", ["target", "mtp"])
def test_resume_continues_at_the_same_step_and_data(tmp_path, smoke, stage):
    recipe, corpus = smoke
    sc = dataclasses.replace(recipe.stages[stage], steps=6, ckpt_every=2, eval_every=3)
    model = init_model(recipe.target, seed=0)
    straight, info = run_stage(stage, model, corpus, sc, tmp_path / "a", progress=False)
    assert info["step"] == 6 and info["tokens"] == 6 * sc.batch * sc.seq_len
    # a kill at step 5: the checkpoint of step 4 survives; --resume redoes step 5 and 6
    _, cut = run_stage(stage, model, corpus, sc, tmp_path / "b", progress=False, stop_at=5)
    assert cut["step"] == 5
    resumed, info = run_stage(stage, model, corpus, sc, tmp_path / "b", progress=False, resume=True)
    assert info["step"] == 6
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(model.params["mtp"]),
                                                        jax.tree.leaves(straight.params["mtp"]), strict=True)]
    assert all(changed) if stage == "mtp" else not any(changed)  # target stage leaves MTP alone


def test_resume_refuses_other_settings(tmp_path, smoke):
    recipe, corpus = smoke
    sc = dataclasses.replace(recipe.stages["draft"], steps=4, ckpt_every=2)
    model = init_model(recipe.draft)
    run_stage("draft", model, corpus, sc, tmp_path, progress=False, stop_at=2)
    with pytest.raises(ValueError, match="different stage settings"):
        run_stage("draft", model, corpus, dataclasses.replace(sc, lr=1.0), tmp_path, progress=False, resume=True)


def test_training_lowers_held_out_loss(tmp_path, smoke):
    recipe, corpus = smoke
    sc = dataclasses.replace(recipe.stages["target"], steps=30, eval_every=30, ckpt_every=30, lr=3e-2, warmup=3)
    model = init_model(recipe.target, seed=0)
    from specjax.train import eval_windows, evaluate

    before = evaluate("target", model.params, model.config, eval_windows(corpus.held_out, sc.seq_len, 4))
    _, info = run_stage("target", model, corpus, sc, tmp_path, progress=False)
    after = info["final_eval"]
    assert after["bits_per_byte"] < before["bits_per_byte"] - 1.0, (before, after)


def test_bits_per_byte_counts_byte_labels_only(smoke):
    from specjax.train import eval_windows, evaluate

    recipe, corpus = smoke
    w = eval_windows(corpus.train, 32, None)
    w = w[(w[:, 1:] >= 256).any(axis=1)][:8]
    assert len(w) >= 2  # windows whose labels include document boundaries (EOS, BOS)
    model = init_model(recipe.target)
    ev = evaluate("target", model.params, model.config, w)
    assert ev["bytes"] == int((w[:, 1:] < 256).sum())
    assert 0 <= ev["accuracy"] <= 1 and ev["bits_per_byte"] > 0
