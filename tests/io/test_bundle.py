"""Bundles on disk (save/load, clear errors), text generation and streaming over a
bundle, ``specjax bench`` and the ``generate``/``bench``/``train`` CLI, on a tiny bundle."""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import numpy as np
import pytest

from specjax.bench import bench, bench_prompts, recipe_pick
from specjax.checkpoint import CheckpointError, load_model, save_bundle
from specjax.cli import main
from specjax.generation import generate
from specjax.model import init_model
from specjax.streaming import stream
from specjax.train import preset


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> pathlib.Path:
    recipe = preset("smoke")
    path = tmp_path_factory.mktemp("bundle") / "tiny"
    save_bundle(path, init_model(recipe.target, seed=1), init_model(recipe.draft, seed=2), dtype="float32")
    return path


@pytest.fixture(scope="module")
def tiny_bundle(tiny):
    return load_model(tiny)


def _copy(tiny: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    dst = tmp_path / "copy"
    shutil.copytree(tiny, dst)
    return dst


def test_round_trip_exact_in_float32_and_rounded_in_bfloat16(tmp_path, tiny_bundle):
    recipe = preset("smoke")
    ref = init_model(recipe.target, seed=1)
    for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(tiny_bundle.model.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    save_bundle(tmp_path / "bf16", ref)
    got = load_model(tmp_path / "bf16")
    assert got.draft_model is None and got.meta["dtype"] == "bfloat16"
    for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(got.model.params), strict=True):
        assert b.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(a.astype("bfloat16").astype("float32")), np.asarray(b))


def test_missing_bundle_is_clear(tmp_path):
    with pytest.raises(CheckpointError, match="bundle directory does not exist"):
        load_model(tmp_path / "nope")
    tmp_path.joinpath("empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty/config\.json: missing"):
        load_model(tmp_path / "empty")


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: "{not json", r"config\.json: not valid JSON"),
        (lambda c: json.dumps({**c, "format": "other"}), "'format' must be"),
        (lambda c: json.dumps({**c, "target": {**c["target"], "d_model": 48}}), r"target: .*(cannot restore|shape)"),
        (lambda c: json.dumps({**c, "target": {**c["target"], "n_layers": 3}}), r"target: .*(cannot restore|tensors)"),
        (lambda c: json.dumps({**c, "target": {**c["target"], "wat": 1}}), r"unknown ModelConfig field\(s\) \['wat'\]"),
        (lambda c: json.dumps({**c, "draft": {**c["draft"], "vocab_size": 7}}), "draft vocab_size 7"),
    ],
)
def test_bad_config_is_clear(tmp_path, tiny, edit, match):
    path = _copy(tiny, tmp_path)
    cfg_file = path / "config.json"
    cfg_file.write_text(edit(json.loads(cfg_file.read_text())))
    with pytest.raises(CheckpointError, match=match):
        load_model(path)


def test_truncated_or_missing_tensors_are_clear(tmp_path, tiny):
    path = _copy(tiny, tmp_path)
    data = max((p for p in (path / "target").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"/target: cannot restore"):
        load_model(path)
    shutil.rmtree(path)
    path = _copy(tiny, tmp_path)
    shutil.rmtree(path / "draft")
    with pytest.raises(CheckpointError, match=r"/draft: parameter checkpoint directory is missing"):
        load_model(path)


def test_a_truncated_checkpoint_on_the_cli_is_one_line_without_tracebacks(tmp_path, tiny):
    """The clean error only: reads still in flight when orbax gives up used to print dozens of
    "Event loop is closed" tracebacks after it (in most runs)."""
    import os
    import subprocess
    import sys

    path = _copy(tiny, tmp_path)
    data = max((p for p in (path / "target").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-m", "specjax", "generate", "x", "--model", str(path)],
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 2
        assert proc.stderr.count("\n") == 1 and "cannot restore" in proc.stderr, proc.stderr[-2000:]


def test_bundle_generate_and_stream_agree(tiny_bundle):
    b = tiny_bundle
    prompts = [b.tokenizer.encode(p, bos=True) for p in ("def f(x):\n", "import os\n\nclass A")]
    for drafter in ("mtp", "draft_model"):
        kw = b.generate_kwargs({"drafter": drafter, "max_new_tokens": 12, "kv_advance": "per_sequence"})
        ref = generate(b.model, prompts, **kw)
        chunks = list(stream(b.model, prompts, **kw))
        assert chunks[-1].result is not None and all(c.result is None for c in chunks[:-1])
        got = [sum((c.new_tokens[i] for c in chunks), []) for i in range(len(prompts))]
        assert got == ref.tokens == chunks[-1].result.tokens
        assert chunks[-1].result.metrics["tok_per_step"] == ref.metrics["tok_per_step"]
    texts, res = b.generate(["def f(x):\n"], max_new_tokens=5, drafter="ngram")
    assert texts == [b.tokenizer.decode(res.tokens[0])]
    with pytest.raises(ValueError, match="prompts must be a list of strings"):
        b.generate("def f(")


def test_bench_tree_rows_emit_the_chains_tokens_and_compare_with_them(tiny_bundle):
    out = bench(tiny_bundle, batches=(1,), drafters=("mtp",), max_new_tokens=10, n_prompts=2, progress=False,
                workloads=("code",), depth=2, temperatures=(0.0,), trees=("2x1", "dynamic:4,2@3"))
    trees = [r for r in out["rows"] if str(r["depth"]).startswith("tree:")]
    assert [r["depth"] for r in trees] == ["tree:2x1", "tree:dynamic:4,2@3"]
    plain = next(r for r in out["rows"] if r["drafter"] == "none")
    chains = [r for r in out["rows"] if isinstance(r["depth"], int) and r["drafter"] in ("none", "mtp")
              and r["kv_advance"] in ("n/a", "per_sequence")]
    for r in trees:
        assert r["new_tokens"] == plain["new_tokens"] and r["tok_per_step"] >= 1.0
        assert len(r["acceptance_per_position"]) == (2 if r["depth"] == "tree:2x1" else 3)
        best = max(chains, key=lambda x: x["tok_per_s"])
        assert r["vs_best_chain"] == pytest.approx(r["tok_per_s"] / best["tok_per_s"])
    with pytest.raises(ValueError, match="tree='3y' is invalid"):
        bench(tiny_bundle, batches=(1,), drafters=("mtp",), n_prompts=2, progress=False, trees=("3y",))


def test_bench_rows_and_batch_invariance(tiny_bundle):
    out = bench(tiny_bundle, batches=(1, 2), drafters=("mtp",), max_new_tokens=10, n_prompts=2, progress=False,
                workloads=("code",), depth=2)
    depth_rows = [r for r in out["rows"] if r["depth"] not in (0, 2)]  # mtp per_sequence at depth 1 and auto
    assert [(r["temperature"], r["batch"], r["depth"]) for r in depth_rows] == [
        (t, b, k) for t in (0.0, 0.8) for b in (1, 2) for k in (1, "auto")]
    for b in (1, 2):  # greedy: every depth emits the same tokens as plain
        plain = next(r for r in out["rows"] if r["drafter"] == "none" and r["batch"] == b and r["temperature"] == 0)
        for r in depth_rows:
            if r["batch"] == b and r["temperature"] == 0:
                assert r["new_tokens"] == plain["new_tokens"] and r["kv_advance"] == "per_sequence"
    auto = [r for r in depth_rows if r["depth"] == "auto"]
    assert all(abs(sum(r["window_share"]) - 1) < 1e-6 and r["vs_best_fixed"] > 0 for r in auto)
    out["rows"] = [r for r in out["rows"] if r["depth"] in (0, 2)]
    hot = [r for r in out["rows"] if r["temperature"] == 0.8]  # sampled rows beside the greedy ones
    assert len(hot) == 6 and {r["batch"] for r in hot} == {1, 2}
    hot_by = {(r["batch"], r["drafter"], r["kv_advance"]): r for r in hot}
    # per-prompt seeds: a prompt samples the same tokens at B=1 and B=2 (per_sequence)
    assert hot_by[(1, "mtp", "per_sequence")]["new_tokens"] == hot_by[(2, "mtp", "per_sequence")]["new_tokens"]
    assert hot_by[(1, "none", "n/a")]["speedup_vs_plain"] == 1.0
    rows = [r for r in out["rows"] if r["temperature"] == 0.0]
    assert [(r["batch"], r["drafter"], r["kv_advance"]) for r in rows] == [
        (b, d, r) for b in (1, 2) for d, r in (("none", "n/a"), ("mtp", "cohort"), ("mtp", "per_sequence"))]
    by = {(r["batch"], r["drafter"], r["kv_advance"]): r for r in rows}
    assert by[(1, "none", "n/a")]["speedup_vs_plain"] == 1.0 and by[(1, "none", "n/a")]["tok_per_step"] == 1.0
    # per_sequence: each row is batch-invariant, so tok/step over the set is the same at B=1 and B=2
    assert by[(1, "mtp", "per_sequence")]["tok_per_step"] == by[(2, "mtp", "per_sequence")]["tok_per_step"]
    assert by[(2, "mtp", "cohort")]["tok_per_step"] <= by[(2, "mtp", "per_sequence")]["tok_per_step"]
    for b in (1, 2):  # greedy: every configuration emits the same tokens, so the same count (EOS or 10 per row)
        counts = {by[(b, d, r)]["new_tokens"] for d, r in (("none", "n/a"), ("mtp", "cohort"), ("mtp", "per_sequence"))}
        assert len(counts) == 1 and 2 <= counts.pop() <= 2 * 10
    assert len(by[(1, "mtp", "cohort")]["acceptance_per_position"]) == 2
    with pytest.raises(ValueError, match="must be >= 1 and divide"):
        bench(tiny_bundle, batches=(3,), n_prompts=2, progress=False)
    with pytest.raises(ValueError, match=r"rounds=0 is invalid: must be an int >= 1"):
        bench(tiny_bundle, rounds=0, progress=False)
    kw = dict(batches=(2,), drafters=("ngram",), max_new_tokens=10, n_prompts=2, progress=False, workloads=("code",),
              temperatures=(0.0,), depth=2)
    twice = bench(tiny_bundle, rounds=2, **kw)  # a second timed pass: each row its fastest, the counts of one pass
    assert twice["settings"]["rounds"] == 2
    once = {(r["drafter"], r["kv_advance"], r["depth"]): r for r in bench(tiny_bundle, **kw)["rows"]}
    assert [(r["drafter"], r["depth"]) for r in twice["rows"]] == [
        ("none", 0), ("ngram", 2), ("ngram", 2), ("ngram", 1), ("ngram", "auto")]
    for r in twice["rows"]:
        same = once[(r["drafter"], r["kv_advance"], r["depth"])]
        for key in ("new_tokens", "tok_per_step", "mean_proposed_drafts", "compiles_in_timed_pass"):
            assert r[key] == same[key], key
        assert r["tok_per_s"] == r["new_tokens"] / r["seconds"] > 0
        assert len(r["seconds_per_round"]) == 2 and min(r["seconds_per_round"]) == r["seconds"]
        plain = twice["rows"][0]["seconds_per_round"]
        assert r["speedup_vs_plain_per_round"] == [p / s for p, s in zip(plain, r["seconds_per_round"], strict=True)]
    assert len(bench_prompts()) == 64 and all(len(p.encode()) <= 120 for p in bench_prompts())


def test_the_bench_keeps_each_rows_fastest_pass(tiny_bundle, monkeypatch):
    """A row's ``seconds`` is its fastest pass, whichever pass that was: on a clock where every
    call takes longer than the one before, the first pass (not the last) for every row."""
    import types

    import specjax.bench as bench_mod

    clock = [0.0]
    calls = [0]
    real = bench_mod._run

    def slower_each_call(*a, **k):
        calls[0] += 1
        clock[0] += calls[0]
        return real(*a, **k)

    monkeypatch.setattr(bench_mod, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(bench_mod, "_run", slower_each_call)
    out = bench(tiny_bundle, batches=(2,), drafters=("ngram",), max_new_tokens=4, n_prompts=2, progress=False,
                workloads=("code",), temperatures=(0.0,), depth=1, rounds=3)
    for r in out["rows"]:
        first, *later = r["seconds_per_round"]
        assert r["seconds"] == first < min(later), r["seconds_per_round"]


def test_the_bench_recipe_picks_evenly_and_a_shift_picks_none_of_the_same():
    """``recipe_pick``: the bench's own pick (shift 0) and, at shift 0.5, the candidates half way
    between them (``benchmarks/policy_traces.py``'s ``recipe`` set: prompts the bench never used)."""
    cands = list(range(20))
    assert recipe_pick(cands, 5) == [0, 4, 8, 12, 16]
    assert recipe_pick(cands, 5, shift=0.5) == [2, 6, 10, 14, 18]
    assert recipe_pick(list(range(562)), 64, 0.5)[-1] == 557 and not set(recipe_pick(list(range(562)), 64)) & set(
        recipe_pick(list(range(562)), 64, 0.5))
    for bad in (dict(shift=1.0), dict(shift=-0.1), dict(n=21), dict(n=0)):
        with pytest.raises(ValueError, match="shift in \\[0, 1\\), n in \\[1, 20\\]"):
            recipe_pick(cands, **{"n": 5, **bad})


def test_cli_generate_json_and_stream(tiny, capsys):
    assert main(["generate", "--model", str(tiny), "def f(", "--max-new-tokens", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["tokens"][0]) == 6 and out["summary"]["drafter"] == "mtp"
    assert out["summary"]["layer_loop"] == "unrolled"
    assert main(["generate", "--model", str(tiny), "def f(", "--max-new-tokens", "6", "--json",
                 "--layer-loop", "scan"]) == 0
    scan = json.loads(capsys.readouterr().out)
    assert scan["summary"]["layer_loop"] == "scan" and scan["tokens"] == out["tokens"]
    assert main(["generate", "--model", str(tiny), "def f(", "--max-new-tokens", "6", "--stream",
                 "--drafter", "ngram", "--kv-advance", "cohort"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def f(") and "ngram depth 3, cohort:" in text and "tok/step" in text
    greedy = ["generate", "--model", str(tiny), "def f(", "--max-new-tokens", "6", "--json", "--temperature", "0"]
    assert main([*greedy, "--drafter", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*greedy, "--depth", "auto", "--max-depth", "2"]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert auto["tokens"] == plain["tokens"] and auto["summary"]["depth"] == "auto"
    assert auto["summary"]["windows"] == [1, 2, 3] and len(auto["summary"]["window_share"]) == 3
    assert main(["generate", "--model", str(tiny), "x", "--drafter", "mtp", "--depth", "0"]) == 2
    assert "depth=0 is invalid" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        main(["generate", "--model", str(tiny), "x", "--depth", "deep"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--depth: must be an int or 'auto', got 'deep'" in err
    assert main(["generate", "--model", str(tiny / "nope"), "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_bench_json_and_plot(tiny, tmp_path, capsys):
    png = tmp_path / "b.png"
    assert main(["bench", "--model", str(tiny), "--batches", "1", "--drafters", "ngram", "--prompts", "2",
                 "--max-new-tokens", "4", "--temperatures", "0", "--depth", "2", "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"machine", "rows"} and png.stat().st_size > 1000
    assert (tmp_path / "b_depth.png").stat().st_size > 1000 and out["plot_depth"] == str(tmp_path / "b_depth.png")
    assert {r["drafter"] for r in out["rows"]} == {"none", "ngram"}
    mixed = [(r["drafter"], r["depth"]) for r in out["rows"] if r["workload"] == "mixed"]
    assert mixed == [("none", 0), ("ngram", 1), ("ngram", 2), ("ngram", "auto")]
    assert set(out["rows"][0]) >= {"drafter", "kv_advance", "batch", "tok_per_step", "tok_per_s", "speedup_vs_plain"}
    assert main(["bench", "--model", str(tiny), "--drafters", "beam"]) == 2
    assert "drafters=['beam'] is invalid" in capsys.readouterr().err


def test_cli_train_smoke_end_to_end(tmp_path, capsys):
    out = tmp_path / "bundle"
    assert main(["train", "--preset", "smoke", "--run-dir", str(tmp_path / "run"), "--out", str(out), "--json",
                 "--target-steps", "4", "--mtp-steps", "3", "--draft-steps", "3", "--ckpt-every", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in summary["stages"].values()] == [4, 3, 3]
    assert len(summary["held_out_full"]["mtp"]["bits_per_byte"]) == 3
    b = load_model(out)
    assert b.meta["training"]["stages"]["target"]["tokens"] == 4 * 2 * 32
    # --resume over finished stages trains nothing more and exports the same weights
    assert main(["train", "--preset", "smoke", "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "again"),
                 "--json", "--resume", "--target-steps", "4", "--mtp-steps", "3", "--draft-steps", "3",
                 "--ckpt-every", "2"]) == 0
    capsys.readouterr()
    again = load_model(tmp_path / "again")
    for a, c in zip(jax.tree.leaves(b.model.params), jax.tree.leaves(again.model.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    assert main(["train", "--preset", "smoke", "--stages", "target,beam"]) == 2
    assert "stages must be" in capsys.readouterr().err


def test_a_bundle_and_its_models_print_in_one_short_line(tiny_bundle):
    """``repr`` sums up the params (their count and dtype) instead of printing their arrays."""
    for obj in (tiny_bundle, tiny_bundle.model, tiny_bundle.draft_model):
        text = repr(obj)
        assert len(text) < 400 and "\n" not in text and "Array" not in text, text
    assert "M params float32" in repr(tiny_bundle.model) and "MTP depth 1" in repr(tiny_bundle.model)
    assert repr(tiny_bundle).startswith(f"Bundle({str(tiny_bundle.path)!r}, model=Model(")


def test_an_exported_bundle_carries_its_tokenizer_to_the_cli_and_train_mtp(tiny, tiny_bundle, tmp_path, capsys):
    """``save_hf_checkpoint(model, path, tokenizer=bundle.tokenizer)`` writes a tokenizer.json
    that encodes exactly as the byte tokenizer (BOS first), so ``--model DIR`` generates the
    bundle's tokens and ``train-mtp`` trains on it; chat needs a template the bytes lack."""
    import specjax
    from specjax.hf import generate_text, load_tokenizer, save_hf_checkpoint

    out = tmp_path / "hf"
    save_hf_checkpoint(tiny_bundle.model, out, tokenizer=tiny_bundle.tokenizer)
    tok = load_tokenizer(out)
    for text in ("def f(x):\n\treturn x", "héllo ✓", ""):
        assert tok.encode(text) == tiny_bundle.tokenizer.encode(text, bos=True)
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_id == tiny_bundle.tokenizer.eos_id
    greedy = ["def f(", "--max-new-tokens", "6", "--json", "--temperature", "0", "--drafter", "ngram"]
    assert main(["generate", "--model", str(out), *greedy]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert main(["generate", "--model", str(tiny), *greedy]) == 0
    assert exported["tokens"] == json.loads(capsys.readouterr().out)["tokens"]
    data = tmp_path / "corpus.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 40)
    assert main(["train-mtp", "--model", str(out), "--data", str(data), "--out", str(tmp_path / "mtp"), "--steps",
                 "2", "--batch", "2", "--seq-len", "16", "--eval-every", "2", "--ckpt-every", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 2
    with pytest.raises(ValueError, match=r"chat=True is invalid: tokenizer=ByteTokenizer has no chat template"):
        generate_text(tiny_bundle.model, tiny_bundle.tokenizer, ["hi"], chat=True)
    with pytest.raises(ValueError, match=r"tokenizer=dict is invalid"):
        specjax.save_hf_checkpoint(tiny_bundle.model, tmp_path / "bad", tokenizer={})


def test_a_tree_run_names_its_tree(tiny, capsys):
    """A ``--tree`` run's summary line and JSON say which tree ran (not only its depth)."""
    args = ["generate", "--model", str(tiny), "def f(", "--max-new-tokens", "4", "--tree", "2x1"]
    assert main(args) == 0
    assert "mtp tree 2x1 (depth 2), per_sequence:" in capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["tree"] == out["metrics"]["tree"] == "2x1" and out["summary"]["depth"] == 2
