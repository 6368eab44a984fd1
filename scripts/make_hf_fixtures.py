"""Regenerate the tiny Hugging Face fixtures in tests/fixtures/hf (needs torch + transformers).

    pip install torch==2.13.0 transformers tokenizers safetensors
    python scripts/make_hf_fixtures.py

For each of Llama, Qwen2 and Mistral: a random-initialised tiny model saved with
``save_pretrained`` (safetensors), a shared tiny BPE ``tokenizer.json``, and
``expected.json`` holding transformers' logits for three prompts of different lengths
and its greedy ``generate`` output for each, the oracle the tests compare against.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"
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
    return tok


def configs(vocab: int) -> dict:
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                  rope_theta=10000.0, bos_token_id=1, eos_token_id=2, initializer_range=0.15)
    return {
        "llama": (transformers.LlamaConfig(**common, tie_word_embeddings=False), transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config(**common, tie_word_embeddings=True), transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig(**common, sliding_window=4, tie_word_embeddings=False),
                    transformers.MistralForCausalLM),
    }


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
        d = OUT / name
        shutil.rmtree(d, ignore_errors=True)
        model.save_pretrained(d, safe_serialization=True)
        tok.save(str(d / "tokenizer.json"))
        prompts = [[1] + tok.encode(p).ids for p in PROMPTS]
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
        print(name, [len(p) for p in prompts], exp["generated"])


if __name__ == "__main__":
    main()
