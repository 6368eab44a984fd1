"""One frozen ``GenerationConfig`` for every entry point: checked when made, keywords override
it, and the entry points show its fields as their keywords."""

import dataclasses
import inspect

import pytest

import specjax
from specjax import GenerationConfig
from specjax.generation_config import FIELDS

from engine_models import TINY, sharp

MODEL = sharp(TINY)
PROMPTS = [[1, 2, 3, 1, 2], [3, 1]]


def test_keywords_override_the_config_and_give_the_same_tokens():
    cfg = GenerationConfig(max_new_tokens=6, drafter="ngram", depth=2, temperature=1.0, seed=3)
    by_config = specjax.generate(MODEL, PROMPTS, cfg, temperature=0.0)
    by_keywords = specjax.generate(MODEL, PROMPTS, max_new_tokens=6, drafter="ngram", depth=2, seed=3)
    plain = specjax.generate(MODEL, PROMPTS, cfg.replace(drafter=None, temperature=0.0))
    assert by_config.tokens == by_keywords.tokens == plain.tokens  # greedy: the override took
    assert by_config.metrics["drafter"] == "ngram" and plain.metrics["drafter"] == "none"
    assert GenerationConfig.of(cfg, temperature=0.0).temperature == 0.0 and cfg.temperature == 1.0
    streamed = list(specjax.stream(MODEL, PROMPTS, cfg, temperature=0.0))[-1].result
    assert streamed.tokens == by_config.tokens
    jobs = {c.id: c.tokens for c in specjax.batch_generate(MODEL, PROMPTS, cfg, temperature=0.0, slots=2)}
    assert [jobs[0], jobs[1]] == by_config.tokens


def test_a_config_is_frozen_checked_and_takes_lists():
    cfg = GenerationConfig(max_new_tokens=[3, 4], eos_id=[1, 2], seed=[5, 6])
    assert cfg.max_new_tokens == (3, 4) and cfg.eos_id == (1, 2) and cfg.seed == (5, 6)
    hash(GenerationConfig())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.temperature = 1.0
    for bad, match in [(dict(top_p=1.5), r"top_p=1.5 is invalid"), (dict(depth=0), r"depth=0 is invalid"),
                       (dict(max_new_tokens=0), r"max_new_tokens=0 is invalid"),
                       (dict(cache="ring"), r"cache='ring' is invalid"), (dict(seed=-1), r"seed=-1 is invalid"),
                       (dict(eos_id="x"), r"eos_id='x' is invalid"), (dict(ngram_n=0), r"ngram_n=0 is invalid"),
                       (dict(attention_impl="cuda"), r"attention_impl='cuda' is invalid"),
                       (dict(kv_advance="min"), r"kv_advance='min' is invalid")]:
        with pytest.raises(ValueError, match=match):
            GenerationConfig(**bad)
        with pytest.raises(ValueError, match=match):
            GenerationConfig().replace(**bad)
    with pytest.raises(TypeError, match="unknown setting 'temprature'"):
        specjax.generate(MODEL, PROMPTS, temprature=0.5)
    with pytest.raises(ValueError, match="config=.* is invalid"):
        specjax.generate(MODEL, PROMPTS, {"temperature": 0.5})


@pytest.mark.parametrize("fn", [specjax.generate, specjax.stream, specjax.batch_generate])
def test_every_entry_point_shows_the_settings_as_keywords(fn):
    params = inspect.signature(fn).parameters
    assert FIELDS <= set(params)
    assert params["temperature"].default == 0.0 and params["drafter"].default == "auto"
    assert "config" in params and "draft_model" in params and "mesh" in params


def test_the_inputs_a_new_user_got_past_the_checks_are_errors_naming_the_argument():
    """Each reached NumPy, XLA or a silent default before: now a ``ValueError`` naming it."""
    import numpy as np

    from engine_models import noisy

    cases = [
        (dict(temperature=1.0, top_k=2**40), r"top_k=1099511627776 is invalid: must be an int in \[1, 2147483647\]"),
        (dict(drafter="ngram", ngram_n=500), r"ngram_n=500 is invalid: must be less than the token buffer"),
        (dict(tree=(2, 2, 1), depth=2), r"depth=2 is invalid: tree=\[2, 2, 1\] drafts to depth 3"),
        (dict(drafter="draft_model", draft_model=noisy(MODEL, 0.1), tree="dynamic:6,5"),
         r"tree=dynamic:6,5 is invalid: it ranks 5 candidates per node, more than the draft model's vocabulary "
         r"holds \(4\)"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            specjax.generate(MODEL, PROMPTS, max_new_tokens=4, **kw)
    # NumPy scalars are numbers like any other (np.int64 always was; np.float32 was refused)
    cfg = GenerationConfig(temperature=np.float32(0.5), top_p=np.float32(0.9), top_k=np.int64(3))
    assert cfg.temperature == 0.5 and abs(cfg.top_p - 0.9) < 1e-6
    req = specjax.Request([1, 2], temperature=np.float32(0.5), top_p=np.float64(0.5))
    assert len(list(specjax.batch_generate(MODEL, [req], slots=1, max_new_tokens=2))) == 1
    # a preset tree with no depth (or its own) runs at its depth; the default depth is 3
    assert GenerationConfig(tree=(2, 1)).depth is None and GenerationConfig(tree=(2, 1), depth=2).tree == (2, 1)
    assert specjax.generate(MODEL, PROMPTS, max_new_tokens=4, drafter="ngram").metrics["depth"] == 3
