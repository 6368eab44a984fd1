"""Drafters from their public checkpoints (``specjax.load_drafter``): each format's fixture
(``scripts/make_drafter_fixtures.py``: public tensor names, shapes and config keys, random
weights) against draft logits from an independent PyTorch reference forward committed beside
it; greedy output equal to plain decoding with every loaded drafter; one-line errors for
every mismatch before anything compiles; the public layout round trip."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_copies import copy_fixture
from paths import FIXTURES

import specjax
from specjax import load_drafter, load_hf_checkpoint, save_drafter
from specjax.drafter_checkpoints.dflash import default_target_layers
from specjax.model import ModelConfig, init_model
from specjax.model.block import block_draft_logits, block_logits, train_block_hidden, write_context
from specjax.model.llama import hidden_states

FIX = FIXTURES
DRAFTERS = FIX / "drafters"
TARGETS = {"dflash_qwen3": DRAFTERS / "qwen3_target", "dflash_llama": FIX / "hf" / "llama"}


def _loaded(name, dtype=None):
    return load_drafter(DRAFTERS / name, load_hf_checkpoint(TARGETS[name], dtype="float32"), dtype=dtype)


def _expected(name):
    return json.loads((DRAFTERS / name / "expected.json").read_text())


def _draft_logits(m, prompt, anchor):
    """The block at ``anchor`` two ways: the uncached forward, and the engine's cached pass
    (context written through the drafter's cache, then one block over it)."""
    cfg = m.config
    tokens = jnp.array([prompt])
    _, hidden = hidden_states(m, tokens, taps=cfg.block_taps)
    uncached = block_logits(m.params, cfg, train_block_hidden(m.params, cfg, hidden[..., cfg.d_model:], tokens,
                                                              jnp.array([[anchor]]))[:, 0, 1:])
    cache = m.decoder.init_block_cache(1, 32)
    pos = jnp.arange(len(prompt), dtype=jnp.int32)[None]
    n = jnp.array([anchor], jnp.int32)
    cache = write_context(m.params, cfg, hidden, pos, cache, n).advance(n)
    cached, _ = block_draft_logits(m.params, cfg, tokens[:, anchor], anchor + jnp.arange(cfg.block_size)[None], cache)
    return np.asarray(uncached[0]), np.asarray(cached[0])


def test_the_dflash_fixture_target_matches_transformers():
    t = load_hf_checkpoint(TARGETS["dflash_qwen3"], dtype="float32")
    exp = json.loads((TARGETS["dflash_qwen3"] / "expected.json").read_text())
    for prompt, want in zip(exp["prompts"], exp["last_logits"], strict=True):
        got = np.asarray(specjax.logits(t, np.array([prompt])))[0, -1]
        assert np.abs(got - np.array(want)).max() <= 1e-4


@pytest.mark.parametrize("name", ["dflash_qwen3", "dflash_llama"])
def test_dflash_draft_logits_match_the_reference_forward(name):
    """float32, within 1e-3, both passes; the Qwen3 fixture's drafter is shaped apart from its
    target (heads, head_dim, d_ff, RoPE theta) and taps layers out of order, the Llama one's
    target has no q/k norms while the drafter has."""
    m, exp = _loaded(name), _expected(name)
    for prompt, anchor, want in zip(exp["prompts"], exp["anchors"], exp["draft_logits"], strict=True):
        for got in _draft_logits(m, prompt, anchor):
            assert np.abs(got - np.array(want)).max() <= 1e-3


def test_dflash_loads_in_bfloat16():
    m, exp = _loaded("dflash_qwen3", dtype="bfloat16"), _expected("dflash_qwen3")
    assert {str(x.dtype) for x in jax.tree.leaves(m.params["block"])} == {"bfloat16"}
    uncached, _ = _draft_logits(m, exp["prompts"][2], exp["anchors"][2])
    want = np.array(exp["draft_logits"][2])
    assert np.abs(uncached - want).max() <= 0.05 * np.abs(want).max()
    assert (uncached.argmax(-1) == want.argmax(-1)).mean() >= 0.5


def test_dflash_config_maps_onto_the_block_drafter():
    m = _loaded("dflash_qwen3")
    c, bc = m.config, m.config.block_config
    assert (c.block_size, c.block_layers, c.block_taps, c.block_mask_id) == (4, 2, (1, 0), 95)
    assert (bc.n_heads, bc.n_kv_heads, bc.head_dim, bc.d_ff, bc.qk_norm, bc.rope_theta, bc.rope_scaling) == \
        (2, 1, 16, 48, True, 1e6, None)
    assert (c.n_heads, c.head_dim, c.rope_scaling.kind) == (4, 8, "linear")  # the target's own are kept
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B's drafter's taps
    assert default_target_layers(36, 1) == [18]


PROMPTS = [[5, 17, 33, 8, 61], [1, 40, 2, 77, 12, 9, 50, 3, 19, 7, 7], [11, 22, 33], [60, 61, 62, 63, 64, 65, 66]]


@pytest.mark.parametrize(("name", "rule", "cache"), [
    ("dflash_qwen3", "per_sequence", "dense"), ("dflash_qwen3", "cohort", "paged"),
    ("dflash_qwen3", "per_sequence", "paged"), ("dflash_qwen3", "cohort", "dense"),
    ("dflash_llama", "per_sequence", "paged"), ("dflash_llama", "cohort", "dense"),
])
def test_greedy_decoding_with_a_loaded_dflash_drafter_is_plain_decoding(name, rule, cache):
    m = _loaded(name)
    for prompts in (PROMPTS[:1], PROMPTS):  # B = 1 and 4, prompts of different lengths
        plain = specjax.generate(m, prompts, max_new_tokens=16, drafter=None).tokens
        got = specjax.generate(m, prompts, max_new_tokens=16, kv_advance=rule, cache=cache)  # "auto": the block
        assert got.tokens == plain
        assert got.metrics["drafter"] == "block"


def test_greedy_trees_over_a_loaded_dflash_drafter_are_plain_decoding():
    m = _loaded("dflash_qwen3")
    plain = specjax.generate(m, PROMPTS, max_new_tokens=16, drafter=None).tokens
    got = specjax.generate(m, PROMPTS, max_new_tokens=16, drafter="block", tree="dynamic:6,2", cache="paged")
    assert got.tokens == plain


def test_the_public_layout_round_trips(tmp_path):
    """A DFlash drafter saved and loaded back is the same drafter; one made here (attached to
    a specjax model, q/k norms on) too; the bundled drafter (no q/k norms) is refused by name."""
    m = _loaded("dflash_qwen3")
    save_drafter(m, tmp_path / "a")
    back = load_drafter(tmp_path / "a", load_hf_checkpoint(TARGETS["dflash_qwen3"], dtype="float32"))
    assert back.config == m.config
    for a, b in zip(jax.tree.leaves(m.params["block"]), jax.tree.leaves(back.params["block"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ours = init_model(ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=64,
                                  max_seq_len=64, mtp_depth=0, block_size=4, block_layers=1, block_taps=(2, 0),
                                  block_mask_id=63, block_overrides={"qk_norm": True, "n_heads": 2}), seed=3)
    save_drafter(ours, tmp_path / "b")
    target = init_model(ModelConfig(**{**ours.config.to_dict(), "block_size": 0, "block_layers": 0, "block_taps": (),
                                       "block_mask_id": 0, "block_overrides": ()}), seed=3)
    again = load_drafter(tmp_path / "b", target)
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10]]
    assert specjax.generate(again, prompts, max_new_tokens=8, drafter="block").tokens == \
        specjax.generate(ours, prompts, max_new_tokens=8, drafter="block").tokens
    _, d1 = _draft_logits(ours, prompts[0], 4)
    _, d2 = _draft_logits(again, prompts[0], 4)
    np.testing.assert_allclose(d1, d2, atol=1e-5)
    bundle = specjax.load_model()
    with pytest.raises(ValueError, match="cannot express this block drafter's qk_norm=False"):
        save_drafter(bundle.model, tmp_path / "c")


def _copy(tmp_path, name="dflash_qwen3"):
    return copy_fixture(tmp_path, name, DRAFTERS)


def _edit(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if k == "dflash_config":
            cfg[k].update(v)
        elif v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(("change", "says"), [
    ({"hidden_size": 64}, "does not fit the target: hidden size 64 vs the target's 32"),
    ({"vocab_size": 151936}, "vocabulary 151936 vs the target's 96"),
    ({"dflash_config": {"target_layer_ids": [1, 3]}}, "target layer id 3 .* past the target's depth: its layers are "
                                                      "0 .. 2"),
    ({"num_target_layers": 36}, "num_target_layers 36 vs the target's 3 layers"),
    ({"dflash_config": {"mask_token_id": 151669}}, "mask token id 151669 is outside the target's vocabulary"),
    ({"dflash_config": {"mask_token_id": None}, "mask_token_id": None}, "dflash_config.mask_token_id' is missing"),
    ({"block_size": 1}, "'block_size'=1 must be an int >= 2"),
    ({"attention_bias": True}, "'attention_bias'=True is not supported"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "only full-attention drafter layers"),
    ({"num_key_value_heads": 3}, "n_heads=2 must be a multiple of n_kv_heads=3"),
    ({"architectures": ["MedusaModel"], "dflash_config": None},
     "not a drafter format specjax reads .* known formats: dflash: .*; eagle3: "),
])
def test_mismatched_dflash_checkpoints_are_one_line_errors(tmp_path, change, says):
    d = _copy(tmp_path)
    if change.get("dflash_config", 0) is None:
        cfg = json.loads((d / "config.json").read_text())
        cfg.pop("dflash_config")
        (d / "config.json").write_text(json.dumps(cfg))
        change = {k: v for k, v in change.items() if k != "dflash_config"}
    _edit(d, **change)
    target = load_hf_checkpoint(TARGETS["dflash_qwen3"], dtype="float32")
    with pytest.raises(ValueError, match=says) as e:
        load_drafter(d, target)
    assert "\n" not in str(e.value)


def _edited_copy(tmp_path, name, edit_tensors=None, **config):
    """A copy of fixture ``name`` under ``tmp_path`` with ``config`` fields set and its tensors edited."""
    from safetensors.numpy import load_file, save_file

    d = tmp_path / name
    shutil.copytree(DRAFTERS / name, d)
    _edit(d, **config)
    if edit_tensors is not None:
        tensors = load_file(str(d / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(d / "model.safetensors"))
    return d


def test_missing_extra_and_misshapen_tensors_are_named(tmp_path):
    target = load_hf_checkpoint(TARGETS["dflash_qwen3"], dtype="float32")
    for i, (edit, says) in enumerate([(lambda t: t.pop("fc.weight"), "tensor 'fc.weight' is missing"),
                       (lambda t: t.update(extra=np.zeros(2, np.float32)), "tensor 'extra' is not part of the DFlash"),
                       (lambda t: t.update({"norm.weight": np.zeros(3, np.float32)}),
                        "'norm.weight' has shape \\(3,\\), expected \\(32,\\)")]):
        with pytest.raises(ValueError, match=says):
            load_drafter(_edited_copy(tmp_path / str(i), "dflash_qwen3", edit), target)
    with pytest.raises(ValueError, match="is not a directory"):
        load_drafter(tmp_path / "nope", target)
    with pytest.raises(ValueError, match="target=str is invalid"):
        load_drafter(DRAFTERS / "dflash_qwen3", "qwen3")


# ----------------------------------------------------------------------------- native MTP layers

NATIVE = ["mimo", "deepseek_mtp_qwen3"]


@pytest.mark.parametrize("name", NATIVE)
def test_native_mtp_logits_match_the_reference_forward(name):
    """A checkpoint's own MTP layer (MiMo: [hidden ‖ embedding]; DeepSeek-V3 layout on a dense
    Qwen3 target: [embedding ‖ hidden]) loads as the model's MTP module; its logits over every
    prompt position (uncached), the engine's one-slot cached pass at the last one, and a
    chain's second draft (the module's own normed output fed back) match the reference."""
    from specjax.model.layers import norm
    from specjax.model.llama import mtp_hidden, mtp_logits

    m = load_hf_checkpoint(DRAFTERS / name, dtype="float32")
    assert (m.config.mtp_depth, m.config.mtp_layout) == (1, "native")
    dec, cfg = m.decoder, m.config
    exp = json.loads((DRAFTERS / name / "expected.json").read_text())
    for prompt, want in zip(exp["prompts"], exp["mtp"], strict=True):
        tokens, t = jnp.array([prompt]), len(prompt)
        _, hidden = hidden_states(m, tokens)
        pos = jnp.arange(t - 1, dtype=jnp.int32)[None]
        out, _ = mtp_hidden(m.params, cfg, norm(hidden, m.params["final_norm"], cfg)[:, :-1], tokens[:, 1:], pos)
        assert np.abs(np.asarray(mtp_logits(m.params, cfg, out))[0] - np.array(want["logits"])).max() <= 1e-3
        cache = dec.init_mtp_cache(1, 32)
        h, cache = dec.mtp_hidden_at(m.params, hidden[:, :-1], tokens[:, 1:], pos, cache, jnp.array([t - 2]))
        first, _ = dec.mtp_head(m.params, h)
        assert np.abs(np.asarray(first)[0] - np.array(want["logits"][-1])).max() <= 1e-3
        assert int(np.argmax(first[0])) == want["chain_first"]
        cache = cache.replace(lengths=jnp.array([t - 1]))
        h2, _ = dec.mtp_hidden(m.params, h[:, None], jnp.array([[want["chain_first"]]]), jnp.array([[t - 1]]), cache)
        chain, _ = dec.mtp_head(m.params, h2[:, 0])
        assert np.abs(np.asarray(chain)[0] - np.array(want["chain_logits"])).max() <= 1e-3


@pytest.mark.parametrize(("name", "rule", "cache", "tree"), [
    ("mimo", "per_sequence", "dense", None), ("mimo", "cohort", "paged", None),
    ("deepseek_mtp_qwen3", "per_sequence", "paged", None), ("deepseek_mtp_qwen3", "cohort", "dense", None),
    ("mimo", "per_sequence", "paged", "dynamic:6,2"), ("deepseek_mtp_qwen3", "cohort", "dense", "2x2x1"),
])
def test_greedy_decoding_with_a_native_mtp_layer_is_plain_decoding(name, rule, cache, tree):
    m = load_hf_checkpoint(DRAFTERS / name, dtype="float32")
    for prompts in (PROMPTS[:1], PROMPTS):  # B = 1 and 4
        plain = specjax.generate(m, prompts, max_new_tokens=16, drafter=None).tokens
        got = specjax.generate(m, prompts, max_new_tokens=16, kv_advance=rule, cache=cache, tree=tree)
        assert got.tokens == plain
        assert got.metrics["drafter"] == "mtp"


def test_native_mtp_refusals_are_one_line_errors(tmp_path):
    def bump(t):
        t["model.layers.3.shared_head.head.weight"] = t["model.layers.3.shared_head.head.weight"] + 1

    cases = [
        (_edited_copy(tmp_path, "mimo", num_nextn_predict_layers=2), {}, "num_nextn_predict_layers=2: specjax chains "
                                                                         "one MTP module"),
        (_edited_copy(tmp_path / "b", "deepseek_mtp_qwen3", bump), {}, "differs from the target's lm_head: an MTP head "
                                                                      "of its own is not implemented"),
        (DRAFTERS / "mimo", {"mtp": DRAFTERS / "mimo"}, "carries its own MTP layer \\(mimo layout\\)"),
        (_edited_copy(tmp_path / "c", "qwen3_target", architectures=["DeepseekV3ForCausalLM"]), {},
         "DeepseekV3ForCausalLM needs multi-head latent attention \\(MLA\\) and mixture-of-experts layers"),
        (_edited_copy(tmp_path / "d", "qwen3_target", architectures=["Qwen3NextForCausalLM"]), {},
         "Qwen3NextForCausalLM needs linear-attention"),
    ]
    for path, kw, says in cases:
        with pytest.raises(ValueError, match=says) as e:
            load_hf_checkpoint(path, **kw)
        assert "\n" not in str(e.value)


def test_cli_loads_a_draft_checkpoint(capsys):
    from specjax import cli

    args = ["generate", "--model", str(DRAFTERS / "qwen3_target"), "def parse", "--max-new-tokens", "6", "--json"]
    assert cli.main([*args, "--draft-checkpoint", str(DRAFTERS / "dflash_qwen3")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["drafter"] == "block" and len(out["tokens"][0]) == 6
    assert cli.main([*args, "--draft-checkpoint", str(DRAFTERS / "dflash_llama")]) == 2
    err = capsys.readouterr().err
    assert "num_target_layers 2 vs the target's 3 layers" in err and err.count("\n") == 1


# ----------------------------------------------------------------------------- EAGLE-3 heads


def _eagle3(dtype=None):
    return load_drafter(DRAFTERS / "eagle3_qwen3", load_hf_checkpoint(TARGETS["dflash_qwen3"], dtype="float32"),
                        dtype=dtype)


def _eagle3_logits(m, prompt):
    """An EAGLE-3 module's draft logits over a prompt two ways (uncached; the engine's one-slot
    pass at the last position), and a chain's second draft from the first's token."""
    from specjax.model.llama import mtp_hidden, mtp_source

    cfg = m.config
    dec = m.decoder.with_taps(cfg.mtp_taps)
    tokens, t = jnp.array([prompt]), len(prompt)
    _, hidden = hidden_states(m, tokens, taps=cfg.mtp_taps)
    pos = jnp.arange(t - 1, dtype=jnp.int32)[None]
    out, _ = mtp_hidden(m.params, cfg, mtp_source(m.params, cfg, hidden)[:, :-1], tokens[:, 1:], pos)
    uncached, ids = dec.mtp_head(m.params, out)
    h, cache = dec.mtp_hidden_at(m.params, hidden[:, :-1], tokens[:, 1:], pos, dec.init_mtp_cache(1, 32),
                                 jnp.array([t - 2]))
    last, _ = dec.mtp_head(m.params, h)
    first = int(np.argmax(last[0]))
    first = first if ids is None else int(np.asarray(ids)[first])  # a draft vocabulary's id -> the target's
    h2, _ = dec.mtp_hidden(m.params, h[:, None], jnp.array([[first]]), jnp.array([[t - 1]]),
                           cache.replace(lengths=jnp.array([t - 1])))
    chain, _ = dec.mtp_head(m.params, h2[:, 0])
    return np.asarray(uncached[0]), np.asarray(last[0]), first, np.asarray(chain[0])


def test_eagle3_draft_logits_match_the_reference_forward():
    """A Llama-layer head on a Qwen3 target, aux ids out of order and repeated, a draft
    vocabulary: float32 within 1e-3, uncached, the one-slot pass and a chain's second draft."""
    m = _eagle3()
    c = m.config
    assert (c.mtp_layout, c.mtp_taps, c.mtp_draft_vocab, c.mtp_config.n_heads, c.mtp_config.qk_norm) == \
        ("eagle3", (1, 0, 1), 48, 2, False)
    exp = json.loads((DRAFTERS / "eagle3_qwen3" / "expected.json").read_text())
    for prompt, want in zip(exp["prompts"], exp["eagle3"], strict=True):
        uncached, last, first, chain = _eagle3_logits(m, prompt)
        assert np.abs(uncached - np.array(want["logits"])).max() <= 1e-3
        assert np.abs(last - np.array(want["logits"][-1])).max() <= 1e-3
        assert first == want["chain_first"]
        assert np.abs(chain - np.array(want["chain_logits"])).max() <= 1e-3


def test_eagle3_loads_in_bfloat16():
    m = _eagle3("bfloat16")
    assert {str(x.dtype) for x in jax.tree.leaves(m.params["mtp"]) if x.dtype != jnp.int32} == {"bfloat16"}
    exp = json.loads((DRAFTERS / "eagle3_qwen3" / "expected.json").read_text())
    got, want = _eagle3_logits(m, exp["prompts"][2])[0], np.array(exp["eagle3"][2]["logits"])
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()


@pytest.mark.parametrize(("rule", "cache", "tree"), [
    ("per_sequence", "dense", None), ("cohort", "paged", None), ("per_sequence", "paged", "dynamic:6,2"),
    ("cohort", "dense", "2x2x1"),
])
def test_greedy_decoding_with_a_loaded_eagle3_head_is_plain_decoding(rule, cache, tree):
    m = _eagle3()
    for prompts in (PROMPTS[:1], PROMPTS):  # B = 1 and 4
        plain = specjax.generate(m, prompts, max_new_tokens=16, drafter=None).tokens
        got = specjax.generate(m, prompts, max_new_tokens=16, kv_advance=rule, cache=cache, tree=tree)
        assert got.tokens == plain
        assert got.metrics["drafter"] == "mtp"


def test_eagle3_round_trips_through_the_public_layout(tmp_path):
    m = _eagle3()
    save_drafter(m, tmp_path / "a", format="eagle3")
    back = load_drafter(tmp_path / "a", load_hf_checkpoint(TARGETS["dflash_qwen3"], dtype="float32"))
    assert back.config == m.config
    for a, b in zip(jax.tree.leaves(m.params["mtp"]), jax.tree.leaves(back.params["mtp"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ours = init_model(ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=64,
                                  max_seq_len=64, mtp_depth=1, mtp_layout="eagle3", mtp_taps=(0, 1, 2)), seed=4)
    save_drafter(ours, tmp_path / "b", format="eagle3")
    target = init_model(ModelConfig(**{**ours.config.to_dict(), "mtp_depth": 0, "mtp_layout": "specjax",
                                       "mtp_taps": ()}), seed=4)
    again = load_drafter(tmp_path / "b", target)
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10]]
    assert specjax.generate(again, prompts, max_new_tokens=8, depth=3).tokens == \
        specjax.generate(ours, prompts, max_new_tokens=8, depth=3).tokens
    np.testing.assert_allclose(_eagle3_logits(again, prompts[0])[1], _eagle3_logits(ours, prompts[0])[1], atol=1e-5)
    with pytest.raises(ValueError, match="no EAGLE-3 head to save"):
        save_drafter(target, tmp_path / "c", format="eagle3")


@pytest.mark.parametrize(("change", "says"), [
    ({"hidden_size": 64}, "does not fit the target: hidden size 64 vs the target's 32"),
    ({"target_hidden_size": 48}, "target hidden size 48 vs the target's 32"),
    ({"vocab_size": 128}, "vocabulary 128 vs the target's 96"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}, "aux layer id 0 .* outside the target's "
                                                                         "layers 1 .. 3"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}}, "aux layer id 4"),
    ({"num_hidden_layers": 2}, "an EAGLE-3 head has one layer"),
    ({"attention_bias": True}, "'attention_bias'=True is not supported"),
])
def test_mismatched_eagle3_heads_are_one_line_errors(tmp_path, change, says):
    d = tmp_path / "e"
    shutil.copytree(DRAFTERS / "eagle3_qwen3", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=says) as e:
        load_drafter(d, load_hf_checkpoint(TARGETS["dflash_qwen3"], dtype="float32"))
    assert "\n" not in str(e.value)


def test_eagle3_vocabulary_maps_and_embeddings_are_checked(tmp_path):
    target = load_hf_checkpoint(TARGETS["dflash_qwen3"], dtype="float32")
    for i, (edit, says) in enumerate([
        (lambda t: t.update(d2t=t["d2t"] + 50), "d2t maps a draft id to target id .* outside the target's vocabulary"),
        (lambda t: t.update(t2d=np.roll(t["t2d"], 1)), "t2d does not mark the target ids d2t maps to"),
        (lambda t: t.update({"embed_tokens.weight": t["embed_tokens.weight"] * 2}),
         "'embed_tokens.weight' differs from the target's embedding"),
    ]):
        with pytest.raises(ValueError, match=says):
            load_drafter(_edited_copy(tmp_path / str(i), "eagle3_qwen3", edit), target)


def test_an_eagle3_head_trained_here_loads_back_and_drafts_the_same(tmp_path):
    """``train_mtp(layout="eagle3")`` (what ``train-drafter --kind eagle3`` runs): the target
    stays frozen, the loss falls, and the head it writes in the public layout loads back
    (``load_drafter``) drafting what the trained module drafts."""
    from specjax.corpus import Corpus
    from specjax.mtp_head import train_mtp
    from specjax.train import StageConfig

    target = load_hf_checkpoint(TARGETS["dflash_qwen3"], dtype="float32")
    rng = np.random.default_rng(0)
    stream = np.tile(rng.integers(3, 96, 40), 30).astype(np.int32)  # a repeating text: learnable
    corpus = Corpus(stream[:1000], stream[1000:], ("a",), ("b",), "a tiny repeating stream")
    sc = StageConfig(steps=6, batch=4, seq_len=32, lr=1e-2, warmup=1, eval_every=6, eval_windows=4, ckpt_every=6)
    trained, summary = train_mtp(target, corpus, tmp_path / "head", sc, chain=2, progress=False, layout="eagle3",
                                 taps=(2, 0, 1))
    assert trained.config.mtp_layout == "eagle3" and trained.config.mtp_taps == (2, 0, 1)
    for name in ("embed", "final_norm"):
        np.testing.assert_array_equal(np.asarray(trained.params[name]), np.asarray(target.params[name]))
    back = load_drafter(tmp_path / "head", target)
    prompts = [PROMPTS[1], PROMPTS[2]]
    np.testing.assert_allclose(_eagle3_logits(back, prompts[0])[1], _eagle3_logits(trained, prompts[0])[1], atol=1e-5)
    assert specjax.generate(back, prompts, max_new_tokens=8, depth=2).tokens == \
        specjax.generate(target, prompts, max_new_tokens=8, drafter=None).tokens
    assert json.loads((tmp_path / "head" / "training.json").read_text())["chain"] == 2


@pytest.mark.parametrize("name", NATIVE)
def test_native_mtp_layers_load_in_bfloat16(name):
    from specjax.model.layers import norm
    from specjax.model.llama import mtp_hidden, mtp_logits

    m = load_hf_checkpoint(DRAFTERS / name, dtype="bfloat16")
    assert {str(x.dtype) for x in jax.tree.leaves(m.params["mtp"])} == {"bfloat16"}
    want = json.loads((DRAFTERS / name / "expected.json").read_text())["mtp"][2]["logits"]
    prompt = json.loads((DRAFTERS / name / "expected.json").read_text())["prompts"][2]
    tokens = jnp.array([prompt])
    _, hidden = hidden_states(m, tokens)
    out, _ = mtp_hidden(m.params, m.config, norm(hidden, m.params["final_norm"], m.config)[:, :-1], tokens[:, 1:],
                        jnp.arange(len(prompt) - 1, dtype=jnp.int32)[None])
    got, want = np.asarray(mtp_logits(m.params, m.config, out))[0], np.array(want)
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()


def test_a_batch_job_runs_a_draft_checkpoint(tmp_path, capsys):
    """``specjax batch --draft-checkpoint``: the job's greedy text is plain decoding's, drafted
    by the loaded drafter (the DFlash fixture's block drafter on its target)."""
    from specjax import cli

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "max_new_tokens": n}) + "\n"
                           for p, n in (("def parse", 9), ("for i in range(", 5), ("class Engine:", 12))))
    common = ["batch", str(src), "--model", str(DRAFTERS / "qwen3_target"), "--slots", "2", "--temperature", "0",
              "--json"]
    assert cli.main([*common, "--out", str(tmp_path / "plain.jsonl"), "--drafter", "none"]) == 0
    assert cli.main([*common, "--out", str(tmp_path / "block.jsonl"),
                     "--draft-checkpoint", str(DRAFTERS / "dflash_qwen3")]) == 0
    capsys.readouterr()
    read = lambda name: {r["id"]: r["text"] for r in map(json.loads, (tmp_path / name).read_text().splitlines())}  # noqa: E731
    assert read("block.jsonl") == read("plain.jsonl") and len(read("plain.jsonl")) == 3
