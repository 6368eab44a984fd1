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
* ``eagle3_qwen3``: an EAGLE-3 head for ``qwen3_target`` (a Llama layer without q/k norms,
  2/1 heads of 16, ``d_ff`` 48, its own RoPE theta), aux layer ids ``[2, 1, 2]`` (out of order,
  one repeated), a draft vocabulary of 48 of the 96 tokens (``d2t``, ``t2d``), and an
  ``embed_tokens`` copy of the target's.
* ``mimo``: a MiMo checkpoint (``MiMoForCausalLM``: a Qwen2 model) with its MTP layer
  (``model.mtp_layers.0.*``).
* ``deepseek_mtp_qwen3``: ``qwen3_target`` with an MTP layer in the DeepSeek-V3 layout
  (``model.layers.3.*``: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``) on a dense target.
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


# ----------------------------------------------------------------------------- native MTP layers


def mtp_reference(target, w: dict, pre: str, layout: str, tokens: list[int]) -> dict:
    """The MTP layer's draft logits over a prompt, by the DeepSeek-V3 paper's MTP module (section
    2.2) in each layout's tensor names, with the decoder layer run by transformers' own class
    for the target's family: the pair (target hidden at ``i``, embedding of token ``i + 1``),
    each normed, concatenated (MiMo: [hidden ‖ embedding]; DeepSeek: [embedding ‖ hidden]) and
    projected, runs the layer causally at position ``i``; its own final norm, then the target's
    LM head, predicts token ``i + 2``. The target's hidden is its final-normed output (what
    serving engines hand the layer). ``chain``: one more draft from the last position, fed its
    own normed output and the first draft's token at position ``T - 1``."""
    cfg = target.config
    eps = cfg.rms_norm_eps
    hn, en, proj, fin = {"mimo": ("hidden_layernorm", "token_layernorm", "input_proj", "final_layernorm"),
                         "deepseek": ("hnorm", "enorm", "eh_proj", "shared_head.norm")}[layout]
    layer_cls = type(target.model.layers[0])
    layer = layer_cls(cfg, layer_idx=0).eval()
    layer.load_state_dict({k[len(pre):]: v for k, v in w.items() if k.startswith(pre) and k[len(pre):].split(".")[0]
                           in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")})

    def run(h, nxt, positions):
        e = target.get_input_embeddings()(nxt)
        parts = [rms(h, w[pre + hn + ".weight"], eps), rms(e, w[pre + en + ".weight"], eps)]
        x = torch.cat(parts if layout == "mimo" else parts[::-1], -1) @ w[pre + proj + ".weight"].T
        t = x.shape[0]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        pe = target.model.rotary_emb(x[None], positions[None])
        out = layer(x[None], attention_mask=mask, position_embeddings=pe, position_ids=positions[None])
        out = (out[0] if isinstance(out, tuple) else out)[0]
        return rms(out, w[pre + fin + ".weight"], eps)

    with torch.no_grad():
        ids = torch.tensor(tokens)
        hidden = target.model(ids[None]).last_hidden_state[0]  # final-normed
        out = run(hidden[:-1], ids[1:], torch.arange(len(tokens) - 1))
        logits = target.get_output_embeddings()(out)
        first = logits[-1].argmax()
        # the chain's second draft: the module's own (normed) output fed back with the first draft
        h2 = torch.cat([hidden[:-1], out[-1:]])
        nx2 = torch.cat([ids[1:], first[None]])
        out2 = run(h2, nx2, torch.arange(len(tokens)))
        chain = target.get_output_embeddings()(out2[-1])
    return {"logits": logits.tolist(), "chain_first": int(first), "chain_logits": chain.tolist()}


def _mtp_tensors(cfg, pre: str, layout: str, gen: torch.Generator, bias: bool, qk_norm: bool) -> dict:
    d, ff = cfg.hidden_size, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads
    nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    rnd = lambda *s: 0.15 * torch.randn(*s, generator=gen)  # noqa: E731
    unit = lambda n: 1.0 + 0.3 * torch.randn(n, generator=gen)  # noqa: E731
    names = {"mimo": ("hidden_layernorm", "token_layernorm", "input_proj", "final_layernorm"),
             "deepseek": ("hnorm", "enorm", "eh_proj", "shared_head.norm")}[layout]
    w = {pre + names[0] + ".weight": unit(d), pre + names[1] + ".weight": unit(d),
         pre + names[2] + ".weight": rnd(d, 2 * d), pre + names[3] + ".weight": unit(d),
         pre + "input_layernorm.weight": unit(d), pre + "post_attention_layernorm.weight": unit(d),
         pre + "self_attn.q_proj.weight": rnd(nq, d), pre + "self_attn.k_proj.weight": rnd(nkv, d),
         pre + "self_attn.v_proj.weight": rnd(nkv, d), pre + "self_attn.o_proj.weight": rnd(d, nq),
         pre + "mlp.gate_proj.weight": rnd(ff, d), pre + "mlp.up_proj.weight": rnd(ff, d),
         pre + "mlp.down_proj.weight": rnd(d, ff)}
    if bias:
        w.update({pre + "self_attn.q_proj.bias": rnd(nq), pre + "self_attn.k_proj.bias": rnd(nkv),
                  pre + "self_attn.v_proj.bias": rnd(nkv)})
    if qk_norm:
        w.update({pre + "self_attn.q_norm.weight": unit(hd), pre + "self_attn.k_norm.weight": unit(hd)})
    return w


def make_native(name: str, target, layout: str, config_edits: dict, *, bias: bool, qk_norm: bool, seed: int) -> None:
    """A checkpoint folder: ``target`` saved by transformers plus its MTP layer in ``layout``."""
    from safetensors.torch import load_file

    cfg = target.config
    pre = "model.mtp_layers.0." if layout == "mimo" else f"model.layers.{cfg.num_hidden_layers}."
    w = _mtp_tensors(cfg, pre, layout, torch.Generator().manual_seed(seed), bias, qk_norm)
    if layout == "deepseek":  # DeepSeek stores the shared head and the embedding again
        w[pre + "shared_head.head.weight"] = target.get_output_embeddings().weight.detach().clone()
        w[pre + "embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    out = OUT / name
    target.save_pretrained(out, safe_serialization=True)
    tensors = load_file(str(out / "model.safetensors"))
    save_file({**tensors, **{k: v.contiguous() for k, v in w.items()}}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    raw = json.loads((out / "config.json").read_text())
    raw.update(config_edits, num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    shutil.copy(ROOT / "hf" / "qwen3" / "tokenizer.json", out / "tokenizer.json")
    exp = [mtp_reference(target, w, pre, layout, p) for p in PROMPTS]
    (out / "expected.json").write_text(json.dumps({"prompts": PROMPTS, "mtp": exp}))


def make_qwen2_target() -> transformers.PreTrainedModel:
    torch.manual_seed(4)
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                                   initializer_range=0.15, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "eager"
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    _randomise_norms(model, torch.Generator().manual_seed(5))
    return model


# ----------------------------------------------------------------------------- EAGLE-3


def eagle3_reference(w: dict, c: dict, target, tokens: list[int]) -> dict:
    """EAGLE-3's draft logits over a prompt (paper, section 3, and its public layout): the
    feature ``f_i = fc(concat of the target's hidden states entering the aux layers)`` (Hugging
    Face's ``hidden_states[id]``); the pair (``f_i``, token ``i + 1``) at position ``i`` runs
    the one layer, whose q/k/v read [input_layernorm(embedding) ‖ hidden_norm(f_i)] and whose
    residual is ``f_i``, causally; ``lm_head(norm(out_i))`` over the draft vocabulary predicts
    token ``i + 2`` (draft id ``j`` is target id ``j + d2t[j]``). ``chain``: one more draft from
    the last position, fed the layer's own output before ``norm`` and the first draft's token."""
    eps, theta = c["rms_norm_eps"], c["rope_theta"]
    heads, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    ids = c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    p = {k[len("midlayer."):]: v for k, v in w.items() if k.startswith("midlayer.")}

    def layer(f, nxt, pos):
        e = target.get_input_embeddings()(nxt)
        x2 = torch.cat([rms(e, p["input_layernorm.weight"], eps), rms(f, p["hidden_norm.weight"], eps)], -1)
        t = x2.shape[0]
        q = rotate((x2 @ p["self_attn.q_proj.weight"].T).view(t, heads, hd), pos, theta)
        k = rotate((x2 @ p["self_attn.k_proj.weight"].T).view(t, kv, hd), pos, theta)
        v = (x2 @ p["self_attn.v_proj.weight"].T).view(t, kv, hd)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd) + torch.full((t, t), float("-inf")).triu(1)
        x = f + torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v).reshape(t, heads * hd) @ \
            p["self_attn.o_proj.weight"].T
        h = rms(x, p["post_attention_layernorm.weight"], eps)
        return x + (torch.nn.functional.silu(h @ p["mlp.gate_proj.weight"].T) * (h @ p["mlp.up_proj.weight"].T)) @ \
            p["mlp.down_proj.weight"].T

    with torch.no_grad():
        tok = torch.tensor(tokens)
        hs = target(tok[None], output_hidden_states=True).hidden_states
        f = torch.cat([hs[i][0] for i in ids], -1) @ w["fc.weight"].T
        out = layer(f[:-1], tok[1:], torch.arange(len(tokens) - 1))
        logits = rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T
        first = int(logits[-1].argmax())
        first_target = first + int(w["d2t"][first])
        out2 = layer(torch.cat([f[:-1], out[-1:]]), torch.cat([tok[1:], torch.tensor([first_target])]),
                     torch.arange(len(tokens)))
        chain = rms(out2[-1], w["norm.weight"], eps) @ w["lm_head.weight"].T
    return {"logits": logits.tolist(), "chain_first": first_target, "chain_logits": chain.tolist()}


def make_eagle3(name: str, target, *, ids: list[int], heads: int, kv: int, hd: int, ff: int, theta: float,
                draft_vocab: int, seed: int) -> None:
    tc = target.config
    d, vocab = tc.hidden_size, tc.vocab_size
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: 0.15 * torch.randn(*s, generator=gen)  # noqa: E731
    unit = lambda n: 1.0 + 0.3 * torch.randn(n, generator=gen)  # noqa: E731
    chosen = torch.sort(torch.randperm(vocab, generator=gen)[:draft_vocab]).values
    w = {"fc.weight": rnd(d, len(ids) * d), "norm.weight": unit(d), "lm_head.weight": rnd(draft_vocab, d),
         "d2t": chosen - torch.arange(draft_vocab),
         "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill(0, chosen, True),
         "embed_tokens.weight": target.get_input_embeddings().weight.detach().clone(),
         "midlayer.hidden_norm.weight": unit(d), "midlayer.input_layernorm.weight": unit(d),
         "midlayer.post_attention_layernorm.weight": unit(d),
         "midlayer.self_attn.q_proj.weight": rnd(heads * hd, 2 * d),
         "midlayer.self_attn.k_proj.weight": rnd(kv * hd, 2 * d),
         "midlayer.self_attn.v_proj.weight": rnd(kv * hd, 2 * d),
         "midlayer.self_attn.o_proj.weight": rnd(d, heads * hd),
         "midlayer.mlp.gate_proj.weight": rnd(ff, d), "midlayer.mlp.up_proj.weight": rnd(ff, d),
         "midlayer.mlp.down_proj.weight": rnd(d, ff)}
    c = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": d, "vocab_size": vocab,
         "draft_vocab_size": draft_vocab, "num_hidden_layers": 1, "num_attention_heads": heads,
         "num_key_value_heads": kv, "head_dim": hd, "intermediate_size": ff, "rms_norm_eps": 1e-6,
         "rope_theta": theta, "hidden_act": "silu", "max_position_embeddings": 64, "tie_word_embeddings": False,
         "torch_dtype": "float32",
         "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(c, indent=2))
    exp = [eagle3_reference(w, c, target, p) for p in PROMPTS]
    (out / "expected.json").write_text(json.dumps({"prompts": PROMPTS, "eagle3": exp}))


def main() -> None:
    qwen3 = make_target()
    make_dflash("dflash_qwen3", qwen3, layers=2, heads=2, kv=1, hd=16, ff=48, theta=1e6, block=4, mask=95,
                taps=[1, 0], seed=2)
    llama = transformers.LlamaForCausalLM.from_pretrained(ROOT / "hf" / "llama", dtype=torch.float32).eval()
    make_dflash("dflash_llama", llama, layers=1, heads=4, kv=2, hd=8, ff=64, theta=10000.0, block=3, mask=0,
                taps=[0], seed=3)
    make_eagle3("eagle3_qwen3", qwen3, ids=[2, 1, 2], heads=2, kv=1, hd=16, ff=48, theta=5e5, draft_vocab=48,
                seed=8)
    qwen3.config._attn_implementation = "eager"
    make_native("deepseek_mtp_qwen3", qwen3, "deepseek", {}, bias=False, qk_norm=True, seed=6)
    make_native("mimo", make_qwen2_target(), "mimo", {"architectures": ["MiMoForCausalLM"], "model_type": "mimo"},
                bias=True, qk_norm=False, seed=7)
    for f in sorted(OUT.rglob("*")):
        if f.is_file():
            print(f"{f.relative_to(ROOT)}: {f.stat().st_size / 1024:.0f} KB")


if __name__ == "__main__":
    main()
