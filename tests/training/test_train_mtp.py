"""``specjax train-mtp``: an MTP drafting module for a loaded Hugging Face model, trained on
the user's text with the target frozen, saved beside or into the checkpoint, resumable, and
used by ``--drafter mtp`` with tokens equal to transformers' greedy output."""

import json
import shutil

import jax
import numpy as np
import pytest
from mtp_training import train_cli
from paths import FIXTURES

from specjax import cli, generate, load_hf_checkpoint
from specjax.mtp_head import load_mtp, text_corpus, train_mtp
from specjax.train import StageConfig

FIX = FIXTURES / "hf"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The CLI run: 8 steps into a copy of the Llama fixture."""
    return train_cli(tmp_path_factory.mktemp("mtp"), 8)


def test_train_mtp_cli_trains_saves_and_the_drafter_uses_it(trained):
    ckpt, _, summary = trained
    assert summary["step"] == 8 and (ckpt / "mtp.safetensors").exists() and (ckpt / "mtp_config.json").exists()
    final, step4 = summary["final_eval"], json.loads((ckpt / "train" / "log.jsonl").read_text().splitlines()[0])
    assert len(final["bits_per_token"]) == 3 and step4["step"] == 4  # one figure per chained pass
    assert final["bits_per_token"][0] < step4["bits_per_token"][0] < np.log2(96)  # it learns
    model = load_hf_checkpoint(ckpt)  # the module in the checkpoint directory loads with it
    assert model.config.mtp_depth == 1 and "mtp" in model.params
    exp = json.loads((ckpt / "expected.json").read_text())
    for rule in ("per_sequence", "cohort"):
        res = generate(model, exp["prompts"], max_new_tokens=12, drafter="mtp", depth=3, kv_advance=rule, eos_id=2)
        assert res.tokens == exp["generated"]  # transformers' greedy, drafted by the trained head
        assert res.metrics["accepted_drafts"] < sum(res.metrics["proposed_per_position_count"])


def test_module_saved_elsewhere_is_passed_with_mtp_flag(trained, tmp_path, capsys):
    ckpt, _, _ = trained
    elsewhere = tmp_path / "head"
    elsewhere.mkdir()
    for name in ("mtp.safetensors", "mtp_config.json"):
        shutil.copy(ckpt / name, elsewhere / name)
    bare = tmp_path / "bare"
    shutil.copytree(FIX / "llama", bare)
    assert load_hf_checkpoint(bare).config.mtp_depth == 0
    with_head = load_hf_checkpoint(bare, mtp=elsewhere)
    np.testing.assert_array_equal(np.asarray(with_head.params["mtp"]["proj"]),
                                  np.asarray(load_hf_checkpoint(ckpt).params["mtp"]["proj"]))
    exp = json.loads((bare / "expected.json").read_text())
    assert cli.main(["generate", "--model", str(bare), "--mtp", str(elsewhere), "--drafter", "mtp", "def parse",
                     "--max-new-tokens", "12", "--temperature", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == [exp["generated"][0]] and out["summary"]["drafter"] == "mtp"
    with pytest.raises(ValueError, match=r"trained for another model \(.*=.*, this model has"):
        load_mtp(load_hf_checkpoint(FIX / "qwen2"), elsewhere)
    assert cli.main(["train-mtp", "--model", str(bare), "--data", str(tmp_path / "none.txt"), "--out",
                     str(tmp_path / "o")]) == 2
    assert "none.txt: file not found" in capsys.readouterr().err


def test_train_mtp_resumes_to_the_same_weights(trained, tmp_path):
    """Killed at step 4 and resumed: the same module as the straight 8-step run."""
    ckpt, data, _ = trained
    model = load_hf_checkpoint(FIX / "llama", dtype="float32")
    from specjax.hf import load_tokenizer

    tok = load_tokenizer(FIX / "llama")
    corpus = text_corpus(data, tok.encode, eos_id=2, min_tokens=25)
    sc = StageConfig(steps=8, batch=4, seq_len=24, lr=1e-2, warmup=1, eval_every=4, ckpt_every=4)
    out = tmp_path / "run"
    _, part = train_mtp(model, corpus, out, sc, stop_at=4, progress=False)
    assert part["step"] == 4 and not (out / "mtp.safetensors").exists()
    resumed, summary = train_mtp(model, corpus, out, sc, resume=True, progress=False)
    assert summary["step"] == 8
    straight = load_hf_checkpoint(ckpt)
    for a, b in zip(jax.tree.leaves(resumed.params["mtp"]), jax.tree.leaves(straight.params["mtp"]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
