"""Regenerate the tiny Hugging Face fixtures in tests/fixtures/hf (needs torch + transformers).

    pip install torch==2.13.0 transformers tokenizers safetensors
    python scripts/make_hf_fixtures.py

For each family and scaling (Llama, Qwen2, Mistral; Llama with llama3 and with yarn RoPE
scaling; Qwen3 with linear scaling; Gemma 3 with local/global layers): a random-initialised
tiny model saved with ``save_pretrained`` (safetensors; norm weights randomised too, so
``1 + w`` and ``w`` differ), a shared tiny BPE ``tokenizer.json`` (a Llama-style post-processor
adds BOS), and ``expected.json`` holding transformers' logits for three prompts of different
lengths and its greedy ``generate`` output for each, the oracle the tests compare against.
The scaled and Gemma fixtures also carry ``config.legacy.json``: the same model in the
pre-transformers-5 config format (``rope_scaling``/``rope_theta``/``rope_local_base_freq``/
``sliding_window_pattern``), checked here to give transformers the same logits.

``rope_frequencies.json``: transformers' inverse frequencies and attention factor for a
grid of scaling parameters. ``tests/fixtures/tokenizers``: a Llama-3-style tokenizer (BOS by
its post-processor, a chat template, an EOS list in ``generation_config.json``) and a
Qwen-style one (config names a BOS, the tokenizer adds none), with ``AutoTokenizer``'s ids
for 50 strings.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"
TOK_OUT = OUT.parent / "tokenizers"
TEXT = [
    "def parse_args(argv):", "    return parser.parse_args(argv)", "import os, sys", "class Engine:",
    "for i in range(10):", "    print(i * 2)", "if __name__ == '__main__':", "    main()",
    "speculative decoding drafts several tokens per step", "the cache advances per sequence",
] * 20
VOCAB = 96
PROMPTS = ["def parse", "for i in range(", "class Engine:\n    def"]
MAX_NEW = 12


def make_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:60])
    tok.train_from_iterator(TEXT, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16.0, "beta_slow": 1.0}
LINEAR = {"rope_type": "linear", "factor": 2.0}


def configs(vocab: int) -> dict:
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                  rope_theta=10000.0, bos_token_id=1, eos_token_id=2, initializer_range=0.15)
    gemma = {**common, "num_hidden_layers": 4, "head_dim": 8, "sliding_window": 4, "sliding_window_pattern": 2,
             "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": dict(LINEAR, factor=8.0),
             "query_pre_attn_scalar": 24}
    return {
        "llama3_scaling": (transformers.LlamaConfig(**common, rope_scaling=dict(LLAMA3), tie_word_embeddings=False),
                           transformers.LlamaForCausalLM),
        "yarn": (transformers.LlamaConfig(**common, rope_scaling=dict(YARN), tie_word_embeddings=True),
                 transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config(**{**common, "head_dim": 8}, rope_scaling=dict(LINEAR),
                                           tie_word_embeddings=False), transformers.Qwen3ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig(**gemma), transformers.Gemma3ForCausalLM),
        "llama": (transformers.LlamaConfig(**common, tie_word_embeddings=False), transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config(**common, tie_word_embeddings=True), transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig(**common, sliding_window=4, tie_word_embeddings=False),
                    transformers.MistralForCausalLM),
    }


def legacy_config(d: Path) -> dict:
    """The saved (transformers 5) config rewritten in the format older Hub checkpoints use."""
    cfg = json.loads((d / "config.json").read_text())
    rp = cfg.pop("rope_parameters")
    if "full_attention" in rp:  # Gemma 3: per-layer-type parameters
        full, local = dict(rp["full_attention"]), rp["sliding_attention"]
        cfg["rope_local_base_freq"] = local["rope_theta"]
        cfg.pop("layer_types")
        cfg["sliding_window_pattern"] = cfg.pop("_sliding_window_pattern", cfg.get("sliding_window_pattern"))
    else:
        full = dict(rp)
    cfg["rope_theta"] = full.pop("rope_theta")
    cfg["rope_scaling"] = full if full.get("rope_type", "default") != "default" else None
    return cfg


def main() -> None:
    tok = make_tokenizer()
    vocab = tok.get_vocab_size()
    OUT.mkdir(parents=True, exist_ok=True)
    for name, (config, cls) in configs(vocab).items():
        torch.manual_seed(0)
        model = cls(config).eval()
        with torch.no_grad():  # non-zero biases so the bias path is exercised
            for mod in model.modules():
                if isinstance(mod, torch.nn.Linear) and mod.bias is not None:
                    mod.bias.normal_(0, 0.1)
            if name in ("qwen3", "gemma3"):  # norms away from their init: (1 + w) and w must differ
                for pname, prm in model.named_parameters():
                    if "norm" in pname:
                        prm.add_(torch.randn_like(prm) * 0.2)
        d = OUT / name
        shutil.rmtree(d, ignore_errors=True)
        model.save_pretrained(d, safe_serialization=True)
        tok.save(str(d / "tokenizer.json"))
        prompts = [tok.encode(p).ids for p in PROMPTS]  # BOS by the post-processor
        exp = {"prompts": prompts, "logits": [], "generated": []}
        for ids in prompts:
            x = torch.tensor([ids])
            with torch.no_grad():
                exp["logits"].append(model(x).logits[0].tolist())
                out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False,
                                     eos_token_id=2, pad_token_id=2)
            exp["generated"].append(out[0, len(ids):].tolist())
        exp["transformers"] = transformers.__version__
        (d / "expected.json").write_text(json.dumps(exp))
        if "rope_parameters" in json.loads((d / "config.json").read_text()) and name not in ARCHS_PLAIN:
            legacy = legacy_config(d)
            (d / "config.legacy.json").write_text(json.dumps(legacy, indent=2))
            check = OUT / "_legacy_check"
            shutil.rmtree(check, ignore_errors=True)
            shutil.copytree(d, check)
            (check / "config.json").write_text(json.dumps(legacy))
            again = cls.from_pretrained(check, dtype=torch.float32).eval()
            with torch.no_grad():
                x = torch.tensor([prompts[2]])
                assert torch.equal(again(x).logits, model(x).logits), name
            shutil.rmtree(check)
        print(name, [len(p) for p in prompts], exp["generated"])
    rope_grid()
    tokenizers()


ARCHS_PLAIN = ("llama", "qwen2", "mistral")


def rope_grid() -> None:
    """transformers' RoPE init functions over a grid: the oracle of ``rope_frequencies``."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = []
    for head_dim in (8, 64, 128):
        for theta in (10000.0, 500000.0):
            grid = [dict(LINEAR), dict(LINEAR, factor=8.0), dict(LLAMA3),
                    dict(LLAMA3, factor=32.0, original_max_position_embeddings=8192),
                    dict(YARN), dict(YARN, truncate=False), dict(YARN, attention_factor=0.8),
                    dict(YARN, mscale=0.707, mscale_all_dim=0.707, factor=40.0, beta_fast=32.0),
                    dict(YARN, mscale=1.0, mscale_all_dim=0.5, original_max_position_embeddings=4096)]
            for params in grid:
                cfg = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                               max_position_embeddings=131072, rope_theta=theta,
                                               rope_scaling=dict(params))
                inv, attention = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
                cases.append({"head_dim": head_dim, "theta": theta, "rope_scaling": params,
                              "inv_freq": inv.tolist(), "attention_factor": float(attention)})
    (OUT / "rope_frequencies.json").write_text(json.dumps(cases))
    print("rope grid", len(cases))


STRINGS = [
    "Hello world", "hello  world", "   leading spaces", "trailing spaces   ", "tabs\tand\nnewlines\n\n",
    "def parse_args(argv):\n    return parser.parse_args(argv)", "unicode: café naïve façade", "emoji 🙂🚀 done",
    "中文字符测试", "Ελληνικά κείμενο", "mixed ÄÖÜ äöü ß", "numbers 1234567890 3.14159", "a", "", " ",
    "<|eot_id|>", "text then <|eot_id|> then more", "<|begin_of_text|>already there", "<s> and </s> in text",
    "<|im_start|>user\nhi<|im_end|>", "CamelCaseIdentifier snake_case_identifier", "x=1;y=2;z=x+y",
    "punctuation!?.,;:'\"()[]{}", "   ", "\n", "\r\nwindows line", "multiple     spaces     inside",
    "URL https://example.com/path?q=1", "email name@example.org", "for i in range(10):\n    print(i * 2)",
    "class Engine:\n    def step(self):", "speculative decoding drafts several tokens per step",
    "the cache advances per sequence", "ünïcödé with combining e\u0301", "zero\u200bwidth", "ﬁ ligature",
    "tab\tseparated\tvalues", "trailing newline\n", "ALL CAPS TEXT", "MiXeD cAsE", "0", "00000",
    "a b c d e f g", "'quoted'", '"double quoted"', "back\\slash", "#!/usr/bin/env python",
    "import os, sys", "if __name__ == '__main__':\n    main()", "end.",
]
assert len(STRINGS) == 50

CHAT = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def tokenizers() -> None:
    """Llama-3-style and Qwen-style tokenizer fixtures with AutoTokenizer's ids."""
    base = make_tokenizer()
    styles = {
        "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                    "<|end_header_id|>"], "<|begin_of_text|>", "<|eot_id|>"),
        "qwen": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>"),
    }
    for name, (specials, bos, eos) in styles.items():
        tok = Tokenizer.from_str(base.to_str())
        tok.post_processor = None
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        ids = {t: tok.token_to_id(t) for t in specials}
        if bos is not None:
            tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, ids[bos])])
        else:
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
        d = TOK_OUT / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        tok.save(str(d / "tokenizer.json"))
        tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
                "model_max_length": 1024, "clean_up_tokenization_spaces": False}
        if name == "llama3":
            tcfg["chat_template"] = CHAT
            eos_list = [ids["<|end_of_text|>"], ids["<|eot_id|>"]]
            (d / "generation_config.json").write_text(json.dumps({"bos_token_id": ids[bos],
                                                                  "eos_token_id": eos_list}))
            (d / "config.json").write_text(json.dumps({"bos_token_id": ids[bos],
                                                       "eos_token_id": ids["<|end_of_text|>"]}))
        else:  # Qwen2.5: the config names a BOS that the tokenizer never adds
            (d / "config.json").write_text(json.dumps({"bos_token_id": ids["<|endoftext|>"],
                                                       "eos_token_id": ids["<|im_end|>"]}))
        (d / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
        auto = transformers.AutoTokenizer.from_pretrained(d)
        exp = {"strings": STRINGS, "ids": [auto(s)["input_ids"] for s in STRINGS],
               "decoded": [auto.decode(auto(s)["input_ids"], skip_special_tokens=True) for s in STRINGS],
               "transformers": transformers.__version__}
        if name == "llama3":
            chat = [{"role": "system", "content": "be brief "}, {"role": "user", "content": "def parse"}]
            exp["chat"] = chat
            exp["chat_text"] = auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            ids_out = auto.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
            exp["chat_ids"] = list(ids_out["input_ids"])
        (d / "expected.json").write_text(json.dumps(exp, ensure_ascii=False))
        print("tokenizer", name, exp["ids"][:3])


if __name__ == "__main__":
    main()
