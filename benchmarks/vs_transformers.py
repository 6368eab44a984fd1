"""specjax vs transformers on the same weights: the bundled model exported to Hugging Face
format, greedy, one interleaved run, token identity checked.

    pip install torch==2.13.0 transformers     # optional extra (specjax[hf-live]); CPU build
    python benchmarks/vs_transformers.py [--json] [--batches 1 8 32] [--threads 2]

For each batch size B in ``--batches`` (prompts: the fixed held-out bench prompts, 128 new
tokens, no EOS stop so every row makes exactly 128 tokens), the configurations run back to
back in one process, each compiled/warmed once, then timed once over all prompts:

* transformers plain greedy (``model.generate``, left padding + attention mask);
* transformers prompt lookup (``prompt_lookup_num_tokens=3``) and assisted generation
  with the bundled draft model, at B=1 only (transformers supports them only there);
* specjax plain, MTP depth 3, n-gram depth 3 and the draft model depth 3, per_sequence.

tok/s counts generated tokens over wall time. ``same_tokens`` compares every row with
transformers plain greedy (float32 on both sides).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time


def _require():
    try:
        import torch
        import transformers
    except ImportError:
        sys.exit("vs_transformers: needs torch and transformers: pip install torch==2.13.0 transformers")
    return torch, transformers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompts", type=int, default=32, help="first N of the 64 fixed bench prompts")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (XLA:CPU uses the machine)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch, transformers = _require()
    torch.set_num_threads(args.threads)

    import numpy as np

    import specjax
    from specjax.bench import bench_prompts, machine
    from specjax.engine import prompt_bucket
    from specjax.hf import save_hf_checkpoint

    bundle = specjax.load_model()
    prompts = bundle.encode_prompts(bench_prompts(args.prompts), bos=False)
    tmp = tempfile.mkdtemp()
    save_hf_checkpoint(bundle.model, f"{tmp}/target")
    save_hf_checkpoint(bundle.draft_model, f"{tmp}/draft")
    load = lambda p: transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()  # noqa: E731
    hf, hf_draft = load(f"{tmp}/target"), load(f"{tmp}/draft")
    for m in (hf, hf_draft):
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = 0
    n = args.new_tokens

    def hf_run(batch, **kw):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)
        return [r[width:].tolist() for r in out]

    def sj_run(batch, **kw):
        return specjax.generate(bundle.model, batch, max_new_tokens=n, depth=3, kv_advance="per_sequence",
                                eos_id=None, **kw).tokens

    configs = [
        ("transformers", "plain", lambda g: hf_run(g)),
        ("transformers", "prompt_lookup", lambda g: hf_run(g, prompt_lookup_num_tokens=3)),
        ("transformers", "assisted (draft model)", lambda g: hf_run(g, assistant_model=hf_draft)),
        ("specjax", "plain", lambda g: sj_run(g, drafter=None)),
        ("specjax", "mtp", lambda g: sj_run(g, drafter="mtp")),
        ("specjax", "ngram", lambda g: sj_run(g, drafter="ngram")),
        ("specjax", "draft_model", lambda g: sj_run(g, drafter="draft_model", draft_model=bundle.draft_model)),
    ]
    rows = []
    for b in args.batches:
        groups = [prompts[i : i + b] for i in range(0, len(prompts) - len(prompts) % b, b)]
        ref = None
        for lib, mode, fn in configs:
            if lib == "transformers" and mode != "plain" and b != 1:
                continue  # transformers runs prompt lookup / assisted generation at batch 1 only
            widths = {prompt_bucket(g): g for g in groups}  # specjax compiles once per bucket: warm each
            for g in widths.values():
                fn(g)
            t0 = time.perf_counter()
            toks = [t for g in groups for t in fn(g)]
            wall = time.perf_counter() - t0
            if ref is None:
                ref = toks
            same = float(np.mean([a == r for a, r in zip(toks, ref, strict=True)]))
            rows.append({"library": lib, "mode": mode, "batch": b, "tok_per_s": sum(map(len, toks)) / wall,
                         "seconds": wall, "same_tokens": same})
            print(f"B={b} {lib} {mode}: {rows[-1]['tok_per_s']:.0f} tok/s, same tokens {same:.2f}", file=sys.stderr)
    for r in rows:
        base = next(x for x in rows if x["batch"] == r["batch"] and x["library"] == "transformers")
        r["vs_transformers_plain"] = r["tok_per_s"] / base["tok_per_s"]
    out = {"machine": machine(), "torch": torch.__version__, "transformers": transformers.__version__,
           "threads": args.threads, "prompts": len(prompts), "new_tokens": n, "rows": rows}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{out['machine']}; torch {out['torch']} ({args.threads} threads), transformers {out['transformers']}")
    print("| B | library | mode | tok/s | vs transformers plain | same tokens |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['library']} | {r['mode']} | {r['tok_per_s']:.0f} | "
              f"{r['vs_transformers_plain']:.2f}x | {r['same_tokens']:.2f} |")


if __name__ == "__main__":
    main()
