"""The bundled default model (checkpoints/default): loads, is trained, drafts well, and
speculative greedy decoding reproduces plain greedy decoding on it."""

from __future__ import annotations

import dataclasses
import json

import pytest
from paths import ROOT

from specjax.bench import bench_prompts
from specjax.checkpoint import DEFAULT_BUNDLE, load_model
from specjax.cli import main
from specjax.corpus import build_corpus
from specjax.generation import generate
from specjax.tokenizer import ByteTokenizer
from specjax.train import eval_windows, evaluate, preset


@pytest.fixture(scope="module")
def bundle():
    return load_model()


def test_bundle_is_the_default_recipe_and_within_size_budget(bundle):
    recipe = preset("default")
    assert bundle.path == DEFAULT_BUNDLE
    # the recipe's target, then the block drafter `specjax train-drafter --kind block` added
    no_block = dataclasses.replace(bundle.model.config, block_size=0, block_layers=0, block_taps=(), block_mask_id=0)
    assert no_block == recipe.target and bundle.draft_model.config == recipe.draft
    assert bundle.model.config.block_size == 8 and bundle.meta["training"]["stages"]["block"]["step"] == 800
    size = sum(p.stat().st_size for p in DEFAULT_BUNDLE.parent.rglob("*") if p.is_file())
    assert size <= 25 * 2**20, size


def test_bundle_is_trained_on_held_out_bytes(bundle):
    """Measured here on a sample of held-out windows (the full-set figure is in the README)."""
    held = build_corpus().held_out
    w = eval_windows(held, 256, 24)
    ev = evaluate("target", bundle.model.params, bundle.model.config, w)
    assert ev["bits_per_byte"] <= 2.3 and ev["accuracy"] >= 0.5, ev
    ev_d = evaluate("draft", bundle.draft_model.params, bundle.draft_model.config, w)
    assert ev_d["bits_per_byte"] < 3.5, ev_d


@pytest.mark.parametrize("drafter", ["mtp", "draft_model"])
def test_speculative_greedy_equals_plain_greedy(bundle, drafter):
    toks = bundle.encode_prompts(bench_prompts(2), bos=False)
    kw = bundle.generate_kwargs({"drafter": drafter})
    plain = generate(bundle.model, toks, max_new_tokens=40, drafter=None, eos_id=kw["eos_id"])
    spec = generate(bundle.model, toks, max_new_tokens=40, depth=3, kv_advance="per_sequence", **kw)
    assert spec.tokens == plain.tokens
    assert spec.metrics["tok_per_step"] > 1.5, spec.metrics  # the trained drafter is accepted


def test_cli_generate_uses_the_bundle_by_default(capsys):
    assert main(["generate", "def parse_args(", "--max-new-tokens", "24", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["tokens"][0]) <= 24 and out["summary"]["drafter"] == "mtp"
    assert out["texts"][0] == ByteTokenizer().decode(out["tokens"][0]) and len(out["texts"][0]) > 0


def test_accepted_drafts_count_only_emitted_ones(bundle):
    """A tight budget cuts accepted drafts (this prompt's drafts are all accepted): they are
    not counted, so accepted drafts never exceed emitted tokens."""
    prompts = [bundle.tokenizer.encode("class Stack:", bos=True)] * 2
    res = generate(bundle.model, prompts, max_new_tokens=3, drafter="mtp", depth=3)
    m = res.metrics
    assert max(max(t) for t in m["row_accepted_trace"]) == 3  # the verifier accepted all 3 drafts
    assert m["emitted"] == 2 * 2  # 1 token from prefill, then the budget leaves 2 per row
    assert m["accepted_drafts"] == 4 and m["mean_accepted_length"] == pytest.approx(3.0)


def test_a_built_wheel_carries_the_bundled_model(tmp_path):
    """``pip wheel .``, unpacked outside the source tree: ``load_model()`` finds the bundle
    inside the installed package and generates."""
    import os
    import pathlib
    import subprocess
    import sys
    import zipfile

    root = ROOT
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(root), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "wheel")], check=True, capture_output=True, timeout=600)
    (wheel,) = (tmp_path / "wheel").glob("specjax-*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import specjax; b = specjax.load_model(); print(b.path); "
            "print(len(b.generate(['def f('], max_new_tokens=4)[1].tokens[0]))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    path, n = out.stdout.split()
    assert pathlib.Path(path) == site / "specjax" / "checkpoints" / "default" and n == "4"


def test_the_bundled_eagle3_head_loads_and_is_accepted(bundle):
    """``checkpoints/default/eagle3`` (``train-drafter --kind eagle3``, the public EAGLE-3
    layout) loads onto the bundled target and drafts its own continuations: greedy output is
    plain decoding's, and it accepts far more than nothing."""
    import specjax

    model = specjax.load_drafter(DEFAULT_BUNDLE / "eagle3", bundle.model)
    assert model.config.mtp_layout == "eagle3"
    toks = bundle.encode_prompts(bench_prompts(4), bos=False)
    plain = generate(bundle.model, toks, max_new_tokens=40, drafter=None)
    spec = generate(model, toks, max_new_tokens=40, depth=3)
    assert spec.tokens == plain.tokens and spec.metrics["drafter"] == "mtp"
    assert spec.metrics["tok_per_step"] > 2.0, spec.metrics
