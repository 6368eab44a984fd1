"""Hugging Face checkpoints: parity with transformers via committed fixtures (no torch
needed), export round trip, tokenizer, clear errors. Live tests run when transformers
and torch are installed (``pip install torch==2.13.0 transformers``)."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from hf_copies import copy_fixture, edit_config
from paths import FIXTURES

from specjax import generate, logits
from specjax.hf import generate_text, load_hf_checkpoint, load_tokenizer, save_hf_checkpoint

FIX = FIXTURES / "hf"
ARCHS = ["llama", "qwen2", "mistral"]


def _load(arch):
    return load_hf_checkpoint(FIX / arch, dtype=jnp.float32), json.loads((FIX / arch / "expected.json").read_text())


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch):
    model, exp = _load(arch)
    for prompt, want in zip(exp["prompts"], exp["logits"], strict=True):
        got = np.asarray(logits(model, np.array([prompt])))[0]
        assert np.abs(got - np.array(want)).max() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("drafter,rule", [(None, "per_sequence"), ("ngram", "per_sequence"), ("ngram", "cohort"),
                                          ("draft_model", "cohort")])
def test_greedy_generate_matches_transformers(arch, drafter, rule):
    model, exp = _load(arch)
    res = generate(model, exp["prompts"], max_new_tokens=12, drafter=drafter, draft_model=model, depth=3,
                   kv_advance=rule, eos_id=2)
    assert res.tokens == exp["generated"]


def test_config_mapping():
    m, _ = _load("mistral")
    assert m.config.sliding_window == 4 and not m.config.qkv_bias and m.config.n_kv_heads == 2
    q, _ = _load("qwen2")
    assert q.config.qkv_bias and q.config.tie_embeddings and "lm_head" not in q.params
    assert load_hf_checkpoint(FIX / "llama").params["embed"].dtype == jnp.float32  # stored dtype kept


def test_sharded_checkpoint(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import save_file

    src = FIX / "llama"
    with safe_open(str(src / "model.safetensors"), framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / fname))
    index = {"weight_map": {k: fname for fname, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(src / "config.json", tmp_path / "config.json")
    a = np.asarray(logits(load_hf_checkpoint(tmp_path), np.array([[1, 5, 9]])))
    b = np.asarray(logits(load_hf_checkpoint(src), np.array([[1, 5, 9]])))
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("arch", ARCHS)
def test_export_round_trip(arch, tmp_path):
    model, exp = _load(arch)
    save_hf_checkpoint(model, tmp_path)
    again = load_hf_checkpoint(tmp_path)
    p = np.array([exp["prompts"][1]])
    np.testing.assert_array_equal(np.asarray(logits(again, p)), np.asarray(logits(model, p)))
    assert again.config == model.config


def test_tokenizer_and_text_generation():
    tok = load_tokenizer(FIX / "llama")
    assert tok.bos_id == 1 and tok.eos_id == 2
    text = "for i in range(10):\n    print(i)"
    ids = tok.encode(text)
    assert ids[0] == 1 and tok.decode(ids) == text
    model, exp = _load("llama")
    texts, res = generate_text(model, tok, ["def parse", "for i in range("], max_new_tokens=12, drafter="ngram")
    assert res.tokens[0] == exp["generated"][0] and res.tokens[1] == exp["generated"][1]
    assert texts[0] == tok.decode(exp["generated"][0])
    with pytest.raises(ValueError, match="prompts must be a list of strings"):
        generate_text(model, tok, "def parse")


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(architectures=["GPT2LMHeadModel"]), r"field 'architectures'=\['GPT2LMHeadModel'\] is not supported"),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), r"rope_type='dynamic', which is not implemented"),
        (dict(hidden_act="gelu"), r"field 'hidden_act'='gelu' is not supported"),
        (dict(hidden_size=48), r"tensor 'model.layers.0.input_layernorm.weight' has shape \(32,\), expected \(48,\)"),
        (dict(num_hidden_layers=3), r"checkpoint tensor 'model.layers.2.input_layernorm.weight' is missing"),
        (dict(num_hidden_layers=1), r"checkpoint tensor 'model.layers.1.*' is not used by this architecture"),
        (dict(vocab_size=None), r"config.json: required field 'vocab_size' is missing"),
    ],
)
def test_unsupported_or_mismatched_checkpoints_are_clear_errors(tmp_path, change, match):
    d = copy_fixture(tmp_path)
    edit_config(d, **change)
    with pytest.raises(ValueError, match=match):
        load_hf_checkpoint(d)


def test_missing_and_truncated_files(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_hf_checkpoint(tmp_path / "nope")
    d = copy_fixture(tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model.safetensors"):
        load_hf_checkpoint(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="neither model.safetensors nor model.safetensors.index.json found"):
        load_hf_checkpoint(d)
    with pytest.raises(ValueError, match="tokenizer.json: file not found"):
        load_tokenizer(tmp_path)


def test_export_refuses_what_transformers_cannot_express():
    from specjax import ModelConfig, init_model

    mixed = init_model(ModelConfig(vocab_size=16, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=32,
                                   max_seq_len=32, sliding_window=4, global_every=2))
    with pytest.raises(ValueError, match="interleaved local/global"):
        save_hf_checkpoint(mixed, "/tmp/never-written")


# ------------------------------------------------------------------ live (transformers installed)


@pytest.mark.parametrize("arch", ARCHS)
def test_live_export_loads_in_transformers(arch, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, exp = _load(arch)
    save_hf_checkpoint(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    p = exp["prompts"][2]
    with torch.no_grad():
        want = hf(torch.tensor([p])).logits[0].numpy()
    assert np.abs(np.asarray(logits(model, np.array([p])))[0] - want).max() <= 1e-4


def test_cli_generate_on_a_local_checkpoint(capsys):
    from specjax import cli

    _, exp = _load("llama")
    assert cli.main(["generate", "--model", str(FIX / "llama"), "def parse", "--max-new-tokens", "12", "--json",
                     "--temperature", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == [exp["generated"][0]]
    assert out["summary"]["drafter"] == "ngram" and out["summary"]["tok_per_step"] >= 1.0
    assert cli.main(["generate", "--model", str(FIX / "nope"), "def parse"]) == 2
    assert "does not exist" in capsys.readouterr().err
