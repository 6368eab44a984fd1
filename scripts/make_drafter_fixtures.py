"""Regenerate the tiny public-layout drafter fixtures in tests/fixtures/drafters (needs torch +
transformers; the tests do not).

    pip install torch==2.13.0 transformers safetensors
    python scripts/make_drafter_fixtures.py

Each fixture is a folder in a drafter's public layout (its ``config.json`` keys and tensor
names and shapes, random weights, norms randomised too) plus ``expected.json``: the draft
logits of a reference forward written here in PyTorch from the method's paper and its public
description, with the target run by transformers (``output_hidden_states``) as the oracle of
the target's hidden states. Nothing here calls specjax.

* ``qwen3_target``: a 3-layer Qwen3 target (linear RoPE scaling) with its logits and the hf
  fixtures' tokenizer.
* ``dflash_qwen3``: a DFlash drafter for it, shaped apart from it (2 layers, 2/1 heads of 16,
  ``d_ff`` 48, its own RoPE theta), tapping layers ``[1, 0]`` (out of order, so a drafter
  that sorts or reverses the taps fails), block 4, mask token 95.
* ``dflash_llama``: a DFlash drafter for ``tests/fixtures/hf/llama`` (a target without q/k
  norms): 1 layer, tapping layer 0, block 3, mask token 0.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
OUT = ROOT / "drafters"
PROMPTS = [[5, 17, 33, 8, 61], [1, 40, 2, 77, 12, 9, 50, 3, 19], [11, 22, 33, 44, 55, 66, 77, 88, 90, 4, 6, 8, 10, 12]]
VOCAB = 96


def _randomise_norms(module: torch.nn.Module, gen: torch.Generator) -> None:
    for name, p in module.named_parameters():
        if "norm" in name or "layernorm" in name:
            with torch.no_grad():
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))


def make_target() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                                   rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=False,
                                   initializer_range=0.15, bos_token_id=1, eos_token_id=2)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    _randomise_norms(model, torch.Generator().manual_seed(1))
    out = OUT / "qwen3_target"
    model.save_pretrained(out, safe_serialization=True)
    shutil.copy(ROOT / "hf" / "qwen3" / "tokenizer.json", out / "tokenizer.json")  # the hf fixtures' tiny BPE
    with torch.no_grad():
        logits = [model(torch.tensor([p])).logits[0, -1].tolist() for p in PROMPTS]
    (out / "expected.json").write_text(json.dumps({"prompts": PROMPTS, "last_logits": logits}))
    return model


# ----------------------------------------------------------------------------- DFlash reference


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x, pos, theta):
    """Rotary embedding of ``x [t, h, hd]`` at ``pos [t]`` (halves rotated against each other)."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos.to(torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None].float(), torch.cat([ang.sin()] * 2, -1)[:, None].float()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def dflash_reference(w: dict, c: dict, target, tokens: list[int], anchor: int) -> torch.Tensor:
    """DFlash's draft logits ``[k - 1, V]`` for the block at ``anchor`` (paper, section 3): the
    context is ``hidden_norm(fc(concat of the target's hidden states after the tapped layers))``
    at positions ``< anchor``; the block is the token at ``anchor`` then ``k - 1`` mask tokens,
    embedded by the target; each drafter layer's queries are the block's, its keys and values
    the context's and the block's (projected by the layer's own k/v, k-normed, rotated at their
    positions), with no mask at all; then the final norm and the target's LM head."""
    eps, k, theta = c["rms_norm_eps"], c["block_size"], c["rope_theta"]
    heads, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    ids, mask = c["dflash_config"]["target_layer_ids"], c["dflash_config"]["mask_token_id"]
    with torch.no_grad():
        hs = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        taps = torch.cat([hs[i + 1][0] for i in ids], -1)[:anchor]
        ctx = rms(taps @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        x = target.get_input_embeddings()(torch.tensor([tokens[anchor]] + [mask] * (k - 1)))
        pos_c, pos_b = torch.arange(anchor), torch.arange(anchor, anchor + k)
        for i in range(c["num_hidden_layers"]):
            pre = f"layers.{i}."
            p = {n[len(pre):]: v for n, v in w.items() if n.startswith(pre)}
            h = rms(x, p["input_layernorm.weight"], eps)
            q = rotate(rms((h @ p["self_attn.q_proj.weight"].T).view(k, heads, hd), p["self_attn.q_norm.weight"], eps),
                       pos_b, theta)
            kk = torch.cat([ctx, h]) @ p["self_attn.k_proj.weight"].T
            kk = rotate(rms(kk.view(-1, kv, hd), p["self_attn.k_norm.weight"], eps), torch.cat([pos_c, pos_b]), theta)
            vv = (torch.cat([ctx, h]) @ p["self_attn.v_proj.weight"].T).view(-1, kv, hd)
            kk, vv = kk.repeat_interleave(heads // kv, 1), vv.repeat_interleave(heads // kv, 1)
            att = torch.softmax(torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(hd), -1)
            x = x + torch.einsum("hqk,khd->qhd", att, vv).reshape(k, heads * hd) @ p["self_attn.o_proj.weight"].T
            h = rms(x, p["post_attention_layernorm.weight"], eps)
            gate, up = h @ p["mlp.gate_proj.weight"].T, h @ p["mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ p["mlp.down_proj.weight"].T
        return target.get_output_embeddings()(rms(x, w["norm.weight"], eps))[1:]


def make_dflash(name: str, target, *, layers: int, heads: int, kv: int, hd: int, ff: int, theta: float, block: int,
                mask: int, taps: list[int], seed: int) -> None:
    tc = target.config
    d = tc.hidden_size
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: 0.15 * torch.randn(*s, generator=gen)  # noqa: E731
    unit = lambda n: 1.0 + 0.3 * torch.randn(n, generator=gen)  # noqa: E731
    w = {"fc.weight": rnd(d, len(taps) * d), "hidden_norm.weight": unit(d), "norm.weight": unit(d)}
    for i in range(layers):
        pre = f"layers.{i}."
        w.update({pre + "input_layernorm.weight": unit(d), pre + "post_attention_layernorm.weight": unit(d),
                  pre + "self_attn.q_proj.weight": rnd(heads * hd, d), pre + "self_attn.k_proj.weight": rnd(kv * hd, d),
                  pre + "self_attn.v_proj.weight": rnd(kv * hd, d), pre + "self_attn.o_proj.weight": rnd(d, heads * hd),
                  pre + "self_attn.q_norm.weight": unit(hd), pre + "self_attn.k_norm.weight": unit(hd),
                  pre + "mlp.gate_proj.weight": rnd(ff, d), pre + "mlp.up_proj.weight": rnd(ff, d),
                  pre + "mlp.down_proj.weight": rnd(d, ff)})
    c = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": d, "vocab_size": tc.vocab_size,
         "num_hidden_layers": layers, "num_target_layers": tc.num_hidden_layers, "block_size": block,
         "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "intermediate_size": ff,
         "rms_norm_eps": 1e-6, "rope_theta": theta, "attention_bias": False, "hidden_act": "silu",
         "max_position_embeddings": 64, "tie_word_embeddings": False, "torch_dtype": "float32",
         "layer_types": ["full_attention"] * layers,
         "dflash_config": {"mask_token_id": mask, "target_layer_ids": taps}}
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(c, indent=2))
    anchors = [len(p) - 1 for p in PROMPTS]
    logits = [dflash_reference(w, c, target, p, a).tolist() for p, a in zip(PROMPTS, anchors, strict=True)]
    (out / "expected.json").write_text(json.dumps({"prompts": PROMPTS, "anchors": anchors, "draft_logits": logits}))


def main() -> None:
    qwen3 = make_target()
    make_dflash("dflash_qwen3", qwen3, layers=2, heads=2, kv=1, hd=16, ff=48, theta=1e6, block=4, mask=95,
                taps=[1, 0], seed=2)
    llama = transformers.LlamaForCausalLM.from_pretrained(ROOT / "hf" / "llama", dtype=torch.float32).eval()
    make_dflash("dflash_llama", llama, layers=1, heads=4, kv=2, hd=8, ff=64, theta=10000.0, block=3, mask=0,
                taps=[0], seed=3)
    for f in sorted(OUT.rglob("*")):
        if f.is_file():
            print(f"{f.relative_to(ROOT)}: {f.stat().st_size / 1024:.0f} KB")


if __name__ == "__main__":
    main()
