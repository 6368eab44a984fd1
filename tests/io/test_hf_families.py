"""Checkpoints people use today: RoPE scaling (linear, llama3, yarn) from both config formats,
Qwen3 and Gemma 3, EOS lists, tokenizers as transformers runs them, bf16. Oracles are the
committed fixtures made by transformers (``scripts/make_hf_fixtures.py``); no torch needed."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_copies import copy_fixture, edit_config
from paths import FIXTURES

import specjax
from specjax import Model, ModelConfig, batch_generate, generate, init_model, logits
from specjax.hf import load_hf_checkpoint, load_tokenizer
from specjax.hf_io import rope_scaling
from specjax.model import layer_loop, with_layer_loop
from specjax.model.rope import rope_frequencies

FIX = FIXTURES / "hf"
TOKS = FIXTURES / "tokenizers"
FAMILIES = ["llama3_scaling", "yarn", "qwen3", "gemma3"]


def _expected(name):
    return json.loads((FIX / name / "expected.json").read_text())


def _legacy_dir(tmp_path, name):
    """The fixture with its config in the pre-transformers-5 format (``config.legacy.json``)."""
    d = copy_fixture(tmp_path, name)
    shutil.copy(d / "config.legacy.json", d / "config.json")
    return d


def _draft(vocab):
    """A draft model that is not the target: random, one layer, same vocabulary (rejects often)."""
    return init_model(ModelConfig(vocab_size=vocab, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32,
                                  max_seq_len=64, mtp_depth=0, tie_embeddings=False), seed=3)


def test_rope_frequencies_match_transformers():
    """Every scaling kind, over head sizes, bases and parameters, as transformers computes it
    (the dicts go through the config parser, so its defaults are checked too)."""
    cases = json.loads((FIX / "rope_frequencies.json").read_text())
    kinds = set()
    for c in cases:
        s = rope_scaling(dict(c["rope_scaling"]), "rope_scaling", {"max_position_embeddings": 131072}, Path("x"))
        inv, factor = rope_frequencies(c["head_dim"], c["theta"], s)
        np.testing.assert_allclose(inv, c["inv_freq"], rtol=2e-6, err_msg=str(c["rope_scaling"]))
        assert factor == pytest.approx(c["attention_factor"], rel=1e-6), c["rope_scaling"]
        kinds.add(s.kind)
    assert kinds == {"linear", "llama3", "yarn"}


@pytest.mark.parametrize("fmt", ["saved", "legacy"])
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(name, fmt, tmp_path):
    d = FIX / name if fmt == "saved" else _legacy_dir(tmp_path, name)
    model, exp = load_hf_checkpoint(d, dtype=jnp.float32), _expected(name)
    scan = with_layer_loop(model, "scan")  # Gemma 3's 4 layers: two local/global periods in the scan
    for prompt, want in zip(exp["prompts"], exp["logits"], strict=True):
        for m in (model, scan):
            got = np.asarray(logits(m, np.array([prompt])))[0]
            assert np.abs(got - np.array(want)).max() <= 1e-4, layer_loop(m.params)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("drafter,rule,cache", [(None, "per_sequence", "dense"), ("ngram", "per_sequence", "paged"),
                                                ("ngram", "cohort", "dense"), ("draft_model", "per_sequence", "dense"),
                                                ("draft_model", "cohort", "paged")])
def test_greedy_generate_matches_transformers(name, drafter, rule, cache):
    model, exp = load_hf_checkpoint(FIX / name), _expected(name)
    res = generate(model, exp["prompts"], max_new_tokens=12, drafter=drafter, draft_model=_draft(96), depth=3,
                   kv_advance=rule, cache=cache, eos_id=2)
    assert res.tokens == exp["generated"]
    if drafter == "draft_model":  # the rejection path ran: a random draft model is mostly wrong
        assert res.metrics["accepted_drafts"] < sum(res.metrics["proposed_per_position_count"])


def test_config_mapping():
    g = load_hf_checkpoint(FIX / "gemma3").config
    assert g.local_layers == (0, 2) and g.global_layers == (1, 3) and g.sliding_window == 4
    assert g.rope_for(0) == (1e4, None) and g.rope_for(1)[0] == 1e6 and g.rope_for(1)[1].factor == 8.0
    assert g.qk_norm and g.sandwich_norm and g.norm_offset == 1.0 and g.mlp_act == "gelu_tanh"
    assert g.embed_scale == pytest.approx(32 ** 0.5) and g.query_pre_attn_scalar == 24 and g.tie_embeddings
    q = load_hf_checkpoint(FIX / "qwen3").config
    assert q.qk_norm and not q.qkv_bias and q.rope_scaling.kind == "linear" and q.head_dim == 8
    y = load_hf_checkpoint(FIX / "yarn").config
    assert y.rope_scaling.kind == "yarn" and y.rope_scaling.original_max_position == 32
    assert specjax.load_hf_checkpoint is load_hf_checkpoint and specjax.load_tokenizer is load_tokenizer
    assert specjax.save_hf_checkpoint is specjax.hf.save_hf_checkpoint


@pytest.mark.parametrize("name,change,match", [
    ("yarn", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     r"rope_type='dynamic', which is not implemented"),
    ("yarn", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                   "partial_rotary_factor": 0.5}), r"partial_rotary_factor=0.5 is not implemented"),
    ("yarn", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}),
     r"RopeScaling.low_freq_factor must be a number > 0"),
    ("yarn", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "short_factor": [1]}),
     r"has key 'short_factor', which is not implemented"),
    ("gemma3", dict(layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention"]),
     r"field 'layer_types'=.* is not periodic"),
    ("gemma3", dict(final_logit_softcapping=30.0), r"field 'final_logit_softcapping'=30.0 is not supported"),
    ("qwen3", dict(attention_bias=True), r"field 'attention_bias'=True is not supported"),
])
def test_unimplemented_config_fields_are_clear_errors(tmp_path, name, change, match):
    d = copy_fixture(tmp_path, name)
    edit_config(d, **change)
    with pytest.raises(ValueError, match=match):
        load_hf_checkpoint(d)


# ------------------------------------------------------------------ stops and tokenizers


def test_eos_list_stops_on_any_id():
    """A row stops at the first of any of its stop ids; ``batch_generate`` rows carry their own lists."""
    model, exp = load_hf_checkpoint(FIX / "qwen3"), _expected("qwen3")
    full = exp["generated"]
    row = full[2]  # [73, 73, 73, 73, 8, 47, ...]: stop on 8 (the second id of the list)
    absent = next(t for t in range(96) if all(t not in g for g in full))
    res = generate(model, exp["prompts"], max_new_tokens=12, drafter="ngram", eos_id=[absent, 8])
    assert res.tokens[2] == row[: row.index(8) + 1]
    for got, want in zip(res.tokens, full, strict=True):
        assert got == (want[: want.index(8) + 1] if 8 in want else want)
    out = {c.id: c for c in batch_generate(model, [{"prompt": p, "eos_id": [absent, 47, 6]} for p in exp["prompts"]],
                                           max_new_tokens=12, drafter="ngram", slots=2, temperature=0.0)}
    assert out[2].tokens == row[: row.index(47) + 1] and out[2].finish_reason == "eos"
    five = [absent, 1, 3, 4, 47]  # longer than EOS_WIDTH: every row's table widens
    out = {c.id: c for c in batch_generate(model, [{"prompt": p, "eos_id": five} for p in exp["prompts"]],
                                           max_new_tokens=12, drafter=None, slots=2, temperature=0.0)}
    assert out[2].tokens == row[: row.index(47) + 1]
    with pytest.raises(ValueError, match=r"eos_id=\[3, 200\] is invalid: every stop id must lie in \[0, 96\)"):
        generate(model, exp["prompts"], max_new_tokens=4, drafter=None, eos_id=[3, 200])
    with pytest.raises(ValueError, match=r"eos_id='x' is invalid"):
        generate(model, exp["prompts"], max_new_tokens=4, drafter=None, eos_id="x")


@pytest.mark.parametrize("style", ["llama3", "qwen"])
def test_tokenizer_parity_with_autotokenizer(style):
    """50 strings (unicode, whitespace runs, special tokens written in the text): the ids and
    decoded text of transformers' AutoTokenizer. Llama 3's post-processor adds BOS; Qwen's
    adds none although its config names one."""
    tok, exp = load_tokenizer(TOKS / style), json.loads((TOKS / style / "expected.json").read_text())
    assert len(exp["strings"]) == 50
    for s, ids, text in zip(exp["strings"], exp["ids"], exp["decoded"], strict=True):
        assert tok.encode(s) == ids, s
        assert tok.decode(ids) == text, s
    assert tok.bos_id is not None
    starts = {ids[0] for ids in exp["ids"] if ids}
    assert (starts == {tok.bos_id}) == (style == "llama3")


def test_stop_ids_and_chat_template_as_transformers():
    tok, exp = load_tokenizer(TOKS / "llama3"), json.loads((TOKS / "llama3" / "expected.json").read_text())
    gen = json.loads((TOKS / "llama3" / "generation_config.json").read_text())
    assert list(tok.eos_ids) == gen["eos_token_id"] and len(tok.eos_ids) == 2 and tok.eos_id == gen["eos_token_id"]
    assert tok.apply_chat_template(exp["chat"]) == exp["chat_text"]
    assert tok.encode_chat(exp["chat"]) == exp["chat_ids"]
    qwen = load_tokenizer(TOKS / "qwen")
    assert qwen.chat_template is None and qwen.eos_id == qwen.eos_ids[0]
    with pytest.raises(ValueError, match="no chat_template"):
        qwen.encode_chat(exp["chat"])


# ------------------------------------------------------------------ bf16


@pytest.mark.parametrize("name", ["llama3_scaling", "gemma3"])
def test_bf16_end_to_end(name):
    """Weights and KV caches in bf16; logits (float32) within 3% of the float32 model's range;
    speculative greedy equals plain greedy in bf16 (both rules, a draft model that rejects)."""
    exp = _expected(name)
    f32 = load_hf_checkpoint(FIX / name, dtype=jnp.float32)
    bf = load_hf_checkpoint(FIX / name, dtype=jnp.bfloat16)
    assert bf.params["embed"].dtype == jnp.bfloat16 and bf.params["layers"][0]["wqkv"].dtype == jnp.bfloat16
    p = np.array([exp["prompts"][2]])
    want, got = np.asarray(logits(f32, p)), np.asarray(logits(bf, p))
    assert got.dtype == np.float32
    assert np.abs(got - want).max() <= 0.03 * np.abs(want).max()
    plain = generate(bf, exp["prompts"], max_new_tokens=12, drafter=None, eos_id=2)
    draft = _draft(96)
    draft = Model(jax.tree.map(lambda x: x.astype(jnp.bfloat16), draft.params), draft.config)
    for rule in ("per_sequence", "cohort"):
        spec = generate(bf, exp["prompts"], max_new_tokens=12, drafter="draft_model", draft_model=draft,
                        kv_advance=rule, eos_id=2)
        assert spec.tokens == plain.tokens
    from specjax.advance import KvAdvance
    from specjax.engine import make_engine

    eng = make_engine(bf, drafter=None, draft_model=None, depth=1, kv_advance_rule=KvAdvance.PER_SEQUENCE,
                      cache="dense", capacity=32)
    assert all(c.k[0].dtype == jnp.bfloat16 for c in eng.new_cache(eng.target, 2).parts)


def test_cli_chat_and_dtype_flags(capsys):
    from specjax import cli

    assert cli.main(["generate", "--chat", "def parse", "--max-new-tokens", "4"]) == 2
    assert "--chat applies to Hugging Face checkpoints" in capsys.readouterr().err
    assert cli.main(["generate", "--model", str(FIX / "qwen3"), "--chat", "def parse"]) == 2
    assert "has no chat_template" in capsys.readouterr().err
    exp = _expected("gemma3")
    assert cli.main(["generate", "--model", str(FIX / "gemma3"), "--dtype", "float32", "def parse",
                     "--max-new-tokens", "12", "--temperature", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == [exp["generated"][0]]


def test_bundle_loads_in_bf16():
    """The bundle in bf16 (weights, KV caches, the MTP module): logits near float32's, and MTP
    speculative greedy equal to plain greedy in bf16 under both rules."""
    from specjax import load_model
    from specjax.bench import bench_prompts

    f32, bf = load_model(), load_model(dtype="bfloat16")
    assert bf.model.params["mtp"]["proj"].dtype == jnp.bfloat16 and bf.draft_model.params["embed"].dtype == jnp.bfloat16
    prompts = [bf.tokenizer.encode(p, bos=True)[:48] for p in bench_prompts()[:3]]
    want, got = np.asarray(logits(f32.model, np.array(prompts))), np.asarray(logits(bf.model, np.array(prompts)))
    assert np.abs(got - want).max() <= 0.03 * np.abs(want).max()
    plain = generate(bf.model, prompts, max_new_tokens=24, drafter=None)
    for rule in ("per_sequence", "cohort"):
        assert generate(bf.model, prompts, max_new_tokens=24, drafter="mtp", kv_advance=rule).tokens == plain.tokens
    with pytest.raises(ValueError, match=r"dtype='int8x' is invalid"):
        load_model(dtype="int8x")


@pytest.mark.parametrize("name", FAMILIES)
def test_mtp_after_train_mtp_matches_transformers(name, tmp_path):
    """Each family drafts with an MTP module ``train_mtp`` made for it (a short run): greedy
    tokens stay transformers' under both rules."""
    from specjax.mtp_head import text_corpus, train_mtp
    from specjax.train import StageConfig

    lines = ["def parse_args(argv):", "    return parser.parse_args(argv)", "for i in range(10):", "class Engine:"]
    data = tmp_path / "data.txt"
    data.write_text("\n".join(lines[i % 4] for i in np.random.default_rng(0).integers(0, 4, 150)))
    tok = load_tokenizer(FIX / name)
    corpus = text_corpus([data], tok.encode, eos_id=2, min_tokens=25)
    sc = StageConfig(steps=4, batch=4, seq_len=24, lr=1e-2, warmup=1, eval_every=4, ckpt_every=4)
    model, summary = train_mtp(load_hf_checkpoint(FIX / name, dtype="float32"), corpus, tmp_path / "mtp", sc,
                               progress=False)
    assert summary["step"] == 4 and model.config.mtp_depth == 1
    exp = _expected(name)
    for rule in ("per_sequence", "cohort"):
        res = generate(model, exp["prompts"], max_new_tokens=12, drafter="mtp", depth=3, kv_advance=rule, eos_id=2)
        assert res.tokens == exp["generated"]
