"""MTP draft vocabularies (``ModelConfig.mtp_draft_vocab``, EAGLE-3's reduced draft vocabulary):
the module drafts over N of the target's tokens through its own [d, N] head; a token outside is
never drafted; greedy and sampled verification stay lossless; save/load, training and bundles
keep the ids exact; the MTP step's head costs N / V of the target's."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from paths import FIXTURES

from specjax import generate, load_hf_checkpoint
from specjax.advance import KvAdvance
from specjax.engine import make_engine, prefill, step
from specjax.model import init_model, with_draft_vocab
from specjax.mtp_head import draft_vocab_ids, load_mtp, save_mtp

from engine_models import GLOBAL, TINY, chi2_pvalue, exact_continuations, sharp

FIX = FIXTURES / "hf"
CFG = dataclasses.replace(GLOBAL, mtp_depth=3, max_seq_len=128)
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]


@pytest.fixture(scope="module")
def target():
    return sharp(CFG, seed=2)


@pytest.fixture(scope="module")
def plain(target):
    return generate(target, PROMPTS, max_new_tokens=24, drafter=None).tokens


def _ids_without(tokens: list[list[int]], vocab: int) -> np.ndarray:
    seen = {t for row in tokens for t in row}
    return np.array([t for t in range(vocab) if t not in seen], np.int32)


@pytest.mark.parametrize("rule", ["per_sequence", "cohort"])
def test_greedy_tokens_are_plain_decodings_with_a_draft_vocabulary(target, plain, rule):
    model = with_draft_vocab(target, np.arange(0, CFG.vocab_size, 2))  # every other token
    out = generate(model, PROMPTS, max_new_tokens=24, drafter="mtp", depth=3, kv_advance=rule)
    assert out.tokens == plain and model.config.mtp_draft_vocab == (CFG.vocab_size + 1) // 2


def test_a_token_outside_the_draft_vocabulary_is_never_drafted(target, plain):
    ids = _ids_without(plain, CFG.vocab_size)  # none of the tokens plain decoding emits
    assert 0 < len(ids) < CFG.vocab_size
    model = with_draft_vocab(target, ids)
    out = generate(model, PROMPTS, max_new_tokens=24, drafter="mtp", depth=3)
    assert out.tokens == plain and out.metrics["accepted_drafts"] == 0
    eng = make_engine(model, drafter="mtp", draft_model=None, depth=3, kv_advance_rule=KvAdvance.PER_SEQUENCE,
                      cache="dense", capacity=64)
    params = {"target": model.params}
    st = prefill(eng, params, np.asarray([p + [0] * (8 - len(p)) for p in PROMPTS], np.int32),
                 np.array([len(p) for p in PROMPTS], np.int32), np.full((3,), 30, np.int32),
                 np.full((3,), -1, np.int32), np.zeros((3,), np.uint32))
    for _ in range(3):
        drafts = np.asarray(eng.drafter.propose(eng, params, st)[0])
        assert np.isin(drafts, ids).all(), drafts
        st = step(eng, params, st)


def test_sampled_mtp_with_a_draft_vocabulary_matches_the_target_distribution():
    """Chi-square over 20,000 3-token continuations (alpha 1e-3): the draft distribution is zero
    outside the vocabulary (tokens 1 and 3 of 4), and rejection sampling keeps the target's."""
    target = sharp(TINY, seed=3, s_emb=2.0, s_head=6.0)
    model = with_draft_vocab(target, [1, 3])
    prompt = [1, 2, 0]
    exact = exact_continuations(target, prompt, 3, 1.0, 1.0)
    samples, accepted = [], 0
    for c in range(10):
        r = generate(model, [prompt] * 2000, max_new_tokens=3, drafter="mtp", depth=2, temperature=1.0,
                     seed=list(range(c * 2000, (c + 1) * 2000)))
        samples += r.tokens
        accepted += r.metrics["accepted_drafts"]
    assert accepted > 0
    assert chi2_pvalue(samples, exact) > 1e-3


def test_the_draft_vocabulary_is_the_most_frequent_tokens():
    stream = np.array([5, 5, 5, 2, 2, 7, 9, 9, 9, 9, 1])
    assert draft_vocab_ids(stream, 3, 12).tolist() == [2, 5, 9]
    assert draft_vocab_ids(stream, 7, 12).tolist() == [0, 1, 2, 3, 5, 7, 9]  # unseen ids fill up from 0
    with pytest.raises(ValueError, match="--draft-vocab"):
        draft_vocab_ids(stream, 12, 12)


def test_save_and_load_keep_the_ids_exact_in_bfloat16(target, tmp_path):
    big = dataclasses.replace(CFG, vocab_size=300_000, d_model=16, n_heads=2, n_kv_heads=1, d_ff=16, n_layers=1)
    model = with_draft_vocab(init_model(big), np.array([0, 299_999, 151_937, 262_143]))
    save_mtp(model, tmp_path)
    assert json.loads((tmp_path / "mtp_config.json").read_text())["draft_vocab"] == 4
    bare = init_model(dataclasses.replace(big, mtp_depth=0), dtype=jnp.bfloat16)
    back = load_mtp(bare, tmp_path)
    assert back.config.mtp_draft_vocab == 4 and back.params["mtp"]["draft_ids"].dtype == jnp.int32
    assert back.params["mtp"]["draft_ids"].tolist() == [0, 299_999, 151_937, 262_143]
    assert back.params["mtp"]["draft_head"].dtype == jnp.bfloat16


def test_the_mtp_step_pays_the_head_over_the_draft_vocabulary_only():
    """Flops of one compiled MTP depth-3 step (XLA's cost analysis): at V = 8192, d = 64, a
    1024-token draft vocabulary takes the step's flops down by most of the MTP heads' share."""
    cfg = dataclasses.replace(CFG, vocab_size=8192, d_model=64, tie_embeddings=True)
    full = init_model(cfg)
    small = with_draft_vocab(full, np.arange(1024))
    flops = {}
    for name, model in (("full", full), ("small", small)):
        eng = make_engine(model, drafter="mtp", draft_model=None, depth=3, kv_advance_rule=KvAdvance.PER_SEQUENCE,
                          cache="dense", capacity=64)
        params = {"target": model.params}
        st = prefill(eng, params, np.ones((2, 8), np.int32), np.array([5, 6], np.int32), np.full((2,), 30, np.int32),
                     np.full((2,), -1, np.int32), np.zeros((2,), np.uint32))
        ca = step.lower(eng, params, st).compile().cost_analysis()
        flops[name] = float((ca[0] if isinstance(ca, list | tuple) else ca)["flops"])
    head = 2 * 2 * 64 * 8192  # one head over the full vocabulary, two rows
    # the step runs the verify head (4 positions, full vocabulary) and 3 MTP heads: 3 * (1 - 1/8) heads saved
    assert flops["full"] - flops["small"] > 0.8 * 3 * head * (1 - 1024 / 8192), flops


def test_train_mtp_with_a_draft_vocabulary_trains_saves_and_stays_lossless(tmp_path):
    from mtp_training import train_cli

    ckpt, _, summary = train_cli(tmp_path, 6, "--draft-vocab", "40")
    assert summary["draft_vocab"] == 40 and np.isfinite(summary["final_eval"]["bits_per_token"]).all()
    model = load_hf_checkpoint(ckpt)
    assert model.config.mtp_draft_vocab == 40 and model.params["mtp"]["draft_head"].shape[1] == 40
    exp = json.loads((ckpt / "expected.json").read_text())
    res = generate(model, exp["prompts"], max_new_tokens=12, drafter="mtp", depth=3, eos_id=2)
    assert res.tokens == exp["generated"]  # transformers' greedy tokens


def test_draft_labels_map_into_the_vocabulary():
    """The MTP loss trains the [d, N] head on each label's index in the draft vocabulary; a label
    outside it is -1 (a miss, out of the loss)."""
    from specjax.losses import cross_entropy, draft_labels

    model = with_draft_vocab(init_model(CFG), [3, 7, 20])
    labels = jnp.array([[7, 3, 5, 20, -1]])
    got = draft_labels(model.params, model.config, labels)
    assert got.tolist() == [[1, 0, -1, 2, -1]]
    logits = jnp.log(jnp.array([[[0.2, 0.7, 0.1]] * 5]))
    nll, hit, cnt = cross_entropy(logits, jnp.maximum(got, 0), False, got >= 0, count_labels=labels)
    assert int(cnt) == 4 and int(hit) == 1  # label 7 -> index 1 is the argmax; label 5 counts as a miss
    np.testing.assert_allclose(float(nll), -np.log(0.7) - np.log(0.2) - np.log(0.1), rtol=1e-5)
