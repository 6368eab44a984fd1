"""Controlled acceptance (specjax.controlled) and the at-scale bench built on it (specjax.scale).

The controlled drafter runs the real drafter and swaps its proposals for the target's greedy
continuation, corrupted per position: tokens must stay plain decoding's, accepted counts must
follow the profile (rates or a replayed trace), rows must not depend on their batch, and the
real drafter's work must stay in the compiled step."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from specjax.controlled import Controlled, control_data, expected_tokens_per_step, oracle_rows
from specjax.generation import generate

from engine_models import GLOBAL, noisy, sharp

CFG = dataclasses.replace(GLOBAL, mtp_depth=3, max_seq_len=256)
NEW = 40


@pytest.fixture(scope="module")
def models():
    target = sharp(CFG)
    return target, noisy(target, 0.3)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in (5, 9, 7)]


@pytest.fixture(scope="module")
def plain(models, prompts):
    return generate(models[0], prompts, max_new_tokens=NEW, drafter=None).tokens


def _run(models, prompts, plain, drafter, rates, trace=None, new=NEW, **kw):
    target, draft = models
    data = control_data(oracle_rows(prompts, plain, 128), rates, trace)
    return generate(target, prompts, max_new_tokens=new, drafter=Controlled(drafter, data), depth=3,
                    draft_model=draft if drafter == "draft_model" else None, seed=[11, 12, 13][: len(prompts)], **kw)


@pytest.mark.parametrize("drafter", ["mtp", "ngram", "draft_model"])
@pytest.mark.parametrize("rule", ["per_sequence", "cohort"])
def test_tokens_are_plain_decodings_for_every_drafter_and_rule(models, prompts, plain, drafter, rule):
    out = _run(models, prompts, plain, drafter, [0.7, 0.6, 0.9], kv_advance=rule)
    assert out.tokens == plain
    assert out.metrics["accepted_drafts"] > 0 and out.metrics["drafter"] == f"{drafter}@controlled"


def test_all_right_accepts_every_draft_and_all_wrong_none(models, prompts, plain):
    right = _run(models, prompts, plain, "mtp", [1.0, 1.0, 1.0]).metrics
    for trace in right["row_accepted_trace"]:
        assert trace[:-1] == [3] * (len(trace) - 1)  # the last step may be cut by the token budget
    wrong = _run(models, prompts, plain, "mtp", [0.0, 0.0, 0.0]).metrics
    assert wrong["accepted_drafts"] == 0 and wrong["tok_per_step"] == 1.0


def test_conditional_acceptance_follows_the_rates(models, plain, prompts):
    rng = np.random.default_rng(7)
    many = [rng.integers(0, CFG.vocab_size, 6).tolist() for _ in range(6)]
    base = generate(models[0], many, max_new_tokens=160, drafter=None).tokens
    rates = [0.8, 0.5, 0.3]
    data = control_data(oracle_rows(many, base, 256), rates)
    out = generate(models[0], many, max_new_tokens=160, drafter=Controlled("ngram", data), depth=3,
                   seed=list(range(6)))
    assert out.tokens == base
    got = out.metrics["conditional_acceptance_per_position"]
    assert np.allclose(got, rates, atol=0.1), got
    assert abs(out.metrics["tok_per_step"] - expected_tokens_per_step(rates, 3)) < 0.25


def test_a_replayed_trace_is_accepted_step_by_step(models, prompts, plain):
    trace = np.array([[2, 0, 3, 1, 1, 0, 2, 3, 0, 1], [0, 0, 1, 3, 3, 2, 0, 1, 2, 2], [3, 3, 3, 0, 2, 1, 0, 0, 1, 1]])
    out = _run(models, prompts, plain, "mtp", [0.0, 0.0, 0.0], trace=trace)
    assert out.tokens == plain
    for row, want in zip(out.metrics["row_accepted_trace"], trace.tolist(), strict=True):
        assert row[:10] == want
        assert all(a == 0 for a in row[10:-1])  # past the trace: the rates (here: nothing right)


def test_a_row_alone_accepts_what_it_accepts_in_a_batch(models, prompts, plain):
    both = _run(models, prompts, plain, "mtp", [0.6, 0.6, 0.6])
    for i in range(len(prompts)):
        target, _ = models
        data = control_data(oracle_rows([prompts[i]], [plain[i]], 128), [0.6, 0.6, 0.6])
        alone = generate(target, [prompts[i]], max_new_tokens=NEW, drafter=Controlled("mtp", data), depth=3,
                         seed=[[11, 12, 13][i]])
        assert alone.tokens[0] == both.tokens[i]
        assert alone.metrics["row_accepted_trace"][0] == both.metrics["row_accepted_trace"][i]


def test_new_rates_and_oracle_do_not_recompile(models, prompts, plain):
    _run(models, prompts, plain, "ngram", [0.5, 0.5, 0.5])
    again = _run(models, prompts, plain, "ngram", [0.9, 0.2, 0.4])
    assert again.metrics["compiles"] == 0 and again.tokens == plain


def test_sampling_is_refused(models, prompts, plain):
    with pytest.raises(ValueError, match="temperature must be 0"):
        _run(models, prompts, plain, "mtp", [0.5], temperature=0.8)


def test_bad_rates_and_trace_are_refused():
    oracle = np.zeros((2, 8), np.int32)
    with pytest.raises(ValueError, match="rates"):
        control_data(oracle, [1.5])
    with pytest.raises(ValueError, match="trace"):
        control_data(oracle, [0.5], np.zeros((3, 4)))
    with pytest.raises(ValueError, match="branch"):
        control_data(oracle, [0.5], None, [0.5, 1.2])


def test_the_real_drafters_work_stays_in_the_step(models, prompts, plain):
    """XLA drops unused work: the controlled MTP step must keep the chain (a wrong draft
    depends on the real one), so it runs at least the real MTP step's ops."""
    from specjax.advance import KvAdvance
    from specjax.engine import make_engine, prefill, step
    from specjax.hlo_ops import count_ops

    target = models[0]
    data = control_data(oracle_rows(prompts[:2], plain[:2], 128), [0.5, 0.5, 0.5])
    counts = {}
    for name, drafter in (("mtp", "mtp"), ("controlled", Controlled("mtp", data))):
        eng = make_engine(target, drafter=drafter, draft_model=None, depth=3, kv_advance_rule=KvAdvance.PER_SEQUENCE,
                          cache="dense", capacity=64)
        params = {"target": target.params, "drafter": data}
        st = prefill(eng, params, np.ones((2, 8), np.int32), np.array([5, 6], np.int32), np.array([30, 30], np.int32),
                     np.full((2,), -1, np.int32), np.zeros((2,), np.uint32))
        ops = count_ops(step.lower(eng, params, st).compile().as_text())
        counts[name] = ops.get("dot", 0) + ops.get("fusion", 0)
    assert counts["controlled"] >= counts["mtp"], counts


def _tree_run(models, prompts, plain, branch, rates=(0.0, 0.0, 0.0), tree=(2, 2, 1), drafter="mtp", new=NEW,
              base=None):
    target, draft = models
    data = control_data(oracle_rows(prompts, plain if base is None else base, 256), list(rates), None, branch)
    return generate(target, prompts, max_new_tokens=new, drafter=Controlled(drafter, data), depth=3, tree=tree,
                    draft_model=draft if drafter == "draft_model" else None, seed=list(range(11, 11 + len(prompts))))


def test_a_controlled_tree_accepts_the_ranks_its_branch_rates_name(models, prompts, plain):
    """Preset 2x2x1 with the second child always right and the first never: levels 1 and 2
    accept through their second children and level 3 (one child) never, so every step takes
    exactly 2 drafts; tokens stay plain decoding's, for the draft model's dynamic tree too."""
    out = _tree_run(models, prompts, plain, [[0.0, 1.0], [0.0, 1.0], [0.0, 1.0]])
    assert out.tokens == plain
    for trace in out.metrics["row_accepted_trace"]:
        assert trace[:-1] == [2] * (len(trace) - 1)
    took = np.asarray(out.metrics["branch_accepted_count"])
    assert took[0, 0] == took[1, 0] == 0 and took[0, 1] == took[1, 1] > 0 and took[2].sum() == 0
    dyn = _tree_run(models, prompts, plain, [[0.9, 0.8], [0.7, 0.6], [0.8, 0.5]], tree="dynamic:6,2",
                    drafter="draft_model")
    assert dyn.tokens == plain and dyn.metrics["accepted_drafts"] > 0


def test_a_trees_first_children_draw_what_the_chain_draws(models, prompts, plain):
    """Rank 0's draws are the chain's (same keys): a tree whose other ranks are never right
    accepts exactly the chain's counts step by step, so a tree and a chain share their luck."""
    rates = [0.7, 0.6, 0.8]
    chain = _run(models, prompts, plain, "mtp", rates).metrics["row_accepted_trace"]
    tree = _tree_run(models, prompts, plain, [[r, 0.0] for r in rates], rates)
    assert tree.metrics["row_accepted_trace"] == chain and tree.tokens == plain


def test_a_controlled_trees_acceptance_per_branch_follows_its_rates(models):
    """Over many steps the run's measured acceptance per branch (``TreeAcceptance.learn``)
    recovers the rates it was given."""
    from specjax.sim import TreeAcceptance

    rng = np.random.default_rng(9)
    many = [rng.integers(0, CFG.vocab_size, 6).tolist() for _ in range(6)]
    base = generate(models[0], many, max_new_tokens=160, drafter=None).tokens
    branch = [[0.5, 0.6], [0.4, 0.7], [0.8, 0.0]]
    out = _tree_run(models, many, base, branch, new=160)
    assert out.tokens == base
    got = TreeAcceptance.learn(out.metrics, (2, 2, 1)).rates
    np.testing.assert_allclose(got[:2], np.asarray(branch)[:2], atol=0.12)
    assert abs(got[2, 0] - 0.8) < 0.12


# ----------------------------------------------------------------------------- shapes and the at-scale bench


@pytest.mark.parametrize("name,billions", [("qwen3-0.6b", 0.596), ("llama3.2-1b", 1.236), ("gemma3-1b", 1.0),
                                           ("llama3.1-8b", 8.03)])
def test_named_shapes_have_their_checkpoints_parameter_counts(name, billions):
    from specjax.model import init_model
    from specjax.model.shapes import shape

    cfg = dataclasses.replace(shape(name), mtp_depth=0)
    params = jax.eval_shape(lambda: init_model(cfg).params)
    n = sum(x.size for x in jax.tree.leaves(params)) / 1e9
    assert abs(n - billions) / billions < 0.01, n


def test_draft_shapes_share_the_vocabulary_and_are_smaller():
    from specjax.model.shapes import SHAPES, draft_shape

    for name, cfg in SHAPES.items():
        d = draft_shape(name)
        assert d.vocab_size == cfg.vocab_size and d.mtp_depth == 0
        assert d.n_layers * d.d_model < cfg.n_layers * cfg.d_model


def test_bench_shape_reports_every_row_at_a_known_acceptance():
    from specjax.model import ModelConfig
    from specjax.scale import DEVICES, bench_shape, random_models, table

    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=128,
                      mtp_depth=2)
    target, draft = random_models(cfg)
    target = sharp(dataclasses.replace(cfg, tie_embeddings=False), seed=1)
    rows = (("none", 0), ("mtp", 1), ("mtp", 2), ("ngram", 2), ("draft_model", 2), ("mtp", 2, "2x1"),
            ("draft_model", 2, "dynamic:3,2"))
    out = bench_shape(cfg, batches=[2], prompt_len=12, max_new_tokens=20, rows=rows, acceptance="rates:1,1",
                      rounds=1, bandwidth=False, progress=False, models=(target, draft))
    (bt,) = out["batches"]
    assert [(r["drafter"], r["depth"]) + ((r["tree"],) if r["tree"] else ()) for r in bt["rows"]] == list(rows)
    assert [r["window"] for r in bt["rows"]] == [1, 2, 3, 3, 3, 5, 4]  # a tree's window: its nodes and the root
    assert out["settings"]["branch_rates"] == {"mtp depth 2 tree 2x1": [[1.0, 1.0], [1.0, 1.0]],
                                               "draft_model depth 2 tree dynamic:3,2": [[1.0, 1.0], [1.0, 1.0]]}
    for r in bt["rows"]:
        assert r["tokens_match_plain"]
        assert r["tok_per_step"] > 0.8 * (r["depth"] + 1)  # every draft right (the last step may be cut)
        assert r["efficiency"] == pytest.approx(r["speedup"] / (r["tok_per_step"] * bt["plain_ms_per_step"]
                                                                / r["forward_ms"]))
        assert set(r["roofline"]["predicted_ms"]) == set(DEVICES) and r["roofline"]["bytes"] > 0
        # the token lookups are charged what they read, not the whole embedding (XLA's count)
        assert r["roofline"]["bytes"] < r["roofline"]["bytes_xla"]
    assert set(bt["forward_ms"]) == {1, 2, 3, 4, 5} and bt["head_ms"] > 0
    assert bt["rows"][5]["expected_tok_per_step"] == 3.0 and bt["rows"][6]["expected_tok_per_step"] is None
    assert "| mtp | 2 |" in table(out) and "| mtp tree 2x1 | 2 |" in table(out)


def test_the_cli_refuses_a_shape_without_random_weights_in_one_line(capsys):
    from specjax import cli

    assert cli.main(["bench", "--shape", "qwen3-0.6b"]) == 2
    assert "add --random" in capsys.readouterr().err
    assert cli.main(["bench", "--shape", "nope", "--random"]) == 2
    assert "qwen3-0.6b" in capsys.readouterr().err
    assert cli.main(["bench", "--shape", "qwen3-0.6b", "--random", "--acceptance", "iid:x"]) == 2
    assert "iid:P" in capsys.readouterr().err
    for trees, said in (("dynamic:6,2+auto", "no +auto"), ("2xa", "tree='2xa' is invalid"),
                        ("dynamic:6,2@x", "then @D"), ("dynamic:6,2@9", "depth 0-7")):
        assert cli.main(["bench", "--shape", "qwen3-0.6b", "--random", "--trees", trees]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err


def test_memory_sizes_the_named_shapes_without_an_mtp_module_unless_it_drafts(capsys):
    import json

    from specjax import cli

    sizes = {}
    for drafter in ("ngram", "mtp"):
        assert cli.main(["memory", "--config", "qwen3-0.6b", "--batch", "1", "--context", "1024", "--drafter",
                         drafter, "--json"]) == 0
        sizes[drafter] = json.loads(capsys.readouterr().out)["params"]
    assert abs(sizes["ngram"] / 2 / 0.596e9 - 1) < 0.01  # bfloat16 weights, tied embeddings
    mtp_block = 2 * (2 * 1024 * 1024 + 1024 * (16 + 8 + 8) * 128 + 16 * 128 * 1024 + 3 * 1024 * 3072)
    assert 0.95 < (sizes["mtp"] - sizes["ngram"]) / mtp_block < 1.05


def test_gather_overcount_is_the_lookup_table_less_what_it_returns():
    from specjax.scale import gather_overcount

    table, idx = jax.ShapeDtypeStruct((4096, 256), np.float32), jax.ShapeDtypeStruct((2, 3), np.int32)
    text = jax.jit(lambda e, i: e[i] * 2).lower(table, idx).compile().as_text()
    assert gather_overcount(text) == 4096 * 256 * 4 - 2 * 3 * 256 * 4


def test_bench_shape_lays_the_layers_out_as_asked(monkeypatch):
    """``layer_loop="scan"``: every row's engine runs the stacked layers (one scan); a bad value
    is refused before anything is built."""
    from specjax import scale
    from specjax.model import ModelConfig
    from specjax.model.llama import layer_loop

    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=128,
                      mtp_depth=1)
    seen = []
    engine = scale._engine
    monkeypatch.setattr(scale, "_engine", lambda target, *a, **kw: seen.append(layer_loop(target.params))
                        or engine(target, *a, **kw))
    out = scale.bench_shape(cfg, batches=[1], prompt_len=8, max_new_tokens=6, rows=(("none", 0), ("mtp", 1)),
                            acceptance="iid:0.5", rounds=1, roofline=False, bandwidth=False, progress=False,
                            layer_loop="scan")
    assert seen == ["scan", "scan"] and out["settings"]["layer_loop"] == "scan"
    assert all(r["tokens_match_plain"] for r in out["batches"][0]["rows"])
    with pytest.raises(ValueError, match="layer_loop='loop' is invalid"):
        scale.bench_shape(cfg, layer_loop="loop", progress=False)


@pytest.mark.filterwarnings("ignore:Some donated buffers")
@pytest.mark.parametrize("drafter,tree", [("mtp", None), ("draft_model", "dynamic:3,2")])
def test_a_steps_timed_parts_compose_to_the_step(models, prompts, drafter, tree):
    """The breakdown times the step's own parts: its verify then its commit give the step's
    state exactly, and the drafter's commit alone gives that state's drafter state."""
    import jax.numpy as jnp

    from specjax.advance import KvAdvance
    from specjax.engine import make_engine, prefill, step
    from specjax.generation_config import GenerationConfig
    from specjax.step_parts import copy_tree, part, part_inputs

    target, draft = models
    eng = make_engine(target, drafter=drafter, draft_model=draft if drafter == "draft_model" else None, depth=2,
                      kv_advance_rule=KvAdvance.PER_SEQUENCE, cache="dense", capacity=64,
                      tree=None if tree is None else GenerationConfig(tree=tree).tree)
    params = {"target": target.params} | ({"draft": draft.params} if drafter == "draft_model" else {})
    b = len(prompts)
    toks = np.zeros((b, 16), np.int32)
    for i, p in enumerate(prompts):
        toks[i, :len(p)] = p
    plen = jnp.asarray([len(p) for p in prompts], jnp.int32)
    st0 = prefill(eng, params, jnp.asarray(toks), plen, plen + 20, jnp.full((b,), -1, jnp.int32),
                  jnp.arange(b, dtype=jnp.uint32))
    st0 = step(eng, params, st0)  # mid-run: rows hold different u and accepted counts
    want = step(eng, params, copy_tree(st0))
    v, new, advance = part_inputs(eng, st0, part(eng, "verify", 1, params, copy_tree(st0)))
    (got, got_v), _ = part(eng, "commit", 1, params, copy_tree((st0, v)))
    got = got.replace(cache=got_v.cache, dstate=got_v.dstate)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    (_, got_v, _, _), _ = part(eng, "drafter_commit", 1, params, copy_tree((st0, v, new, advance)))
    for x, y in zip(jax.tree.leaves(got_v.dstate), jax.tree.leaves(want.dstate), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # the draft part runs the step's own drafter: its proposals are what the verify part drafted
    _, (proposals, _) = part(eng, "draft", 2, params, copy_tree(st0))
    if tree is None:
        np.testing.assert_array_equal(np.asarray(proposals)[:, :2], np.asarray(v.path))


@pytest.mark.filterwarnings("ignore:Some donated buffers")
def test_bench_shape_breaks_a_step_down_into_parts_that_sum_to_it():
    from specjax.model import ModelConfig
    from specjax.scale import PARTS, bench_shape, table

    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=128,
                      mtp_depth=2)
    rows = (("none", 0), ("mtp", 2), ("ngram", 2, "dynamic:3,2"))
    out = bench_shape(cfg, batches=[1], prompt_len=8, max_new_tokens=6, rows=rows, acceptance="iid:0.5", rounds=2,
                      roofline=False, bandwidth=False, progress=False, breakdown_parts=True)
    (bt,) = out["batches"]
    for r in bt["rows"]:
        parts = r["breakdown_ms"]
        assert tuple(parts) == PARTS and parts["forward"] == bt["forward_ms"][r["window"]]
        assert sum(parts.values()) == pytest.approx(r["ms_per_step"])
        assert parts["draft"] > 0 and parts["drafter_commit"] > 0
    assert "where a step's time goes" in table(out) and "| mtp | 2 | 3 |" in table(out)
