"""The bundled default model (checkpoints/default): loads, is trained, drafts well, and
speculative greedy decoding reproduces plain greedy decoding on it."""

from __future__ import annotations

import json

import pytest

from specjax.bench import bench_prompts
from specjax.checkpoint import DEFAULT_BUNDLE, load_model
from specjax.cli import main
from specjax.corpus import build_corpus
from specjax.engine import generate
from specjax.tokenizer import ByteTokenizer
from specjax.train import eval_windows, evaluate, preset


@pytest.fixture(scope="module")
def bundle():
    return load_model()


def test_bundle_is_the_default_recipe_and_within_size_budget(bundle):
    recipe = preset("default")
    assert bundle.path == DEFAULT_BUNDLE
    assert bundle.model.config == recipe.target and bundle.draft_model.config == recipe.draft
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
