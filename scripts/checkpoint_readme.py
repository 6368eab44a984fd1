"""Print the figures table of ``checkpoints/README.md`` from a bundle's ``config.json``.

    python scripts/checkpoint_readme.py [checkpoints/default]
"""

from __future__ import annotations

import json
import pathlib
import sys


def main(argv: list[str]) -> int:
    path = pathlib.Path(argv[0] if argv else "checkpoints/default")
    meta = json.loads((path / "config.json").read_text())
    tr = meta["training"]
    full = tr.get("held_out_full", {})
    print(f"Corpus: {tr['corpus']['source']}: {tr['corpus']['train_files']} training files "
          f"({tr['corpus']['train_bytes']:,} bytes), {tr['corpus']['held_out_files']} held-out files "
          f"({tr['corpus']['held_out_bytes']:,} bytes), fingerprint `{tr['corpus']['fingerprint']}`.\n")
    print("| stage | params | steps | batch x seq | tokens seen | wall time | held-out bits/byte "
          "| next-byte accuracy |")
    print("|---|---|---|---|---|---|---|---|")
    params = _params(path)
    for stage, info in tr["stages"].items():
        sc = info["stage_config"]
        ev = full.get(stage, info.get("final_eval", {}))
        bpb, acc = ev.get("bits_per_byte"), ev.get("accuracy")
        if isinstance(bpb, list):  # MTP: chained draft positions 1..k (predicting t+2, t+3, ...); block: its positions
            bpb = " / ".join(f"{x:.3f}" for x in bpb)
            acc = " / ".join(f"{x:.3f}" for x in acc)
        else:
            bpb, acc = f"{bpb:.3f}", f"{acc:.3f}"
        print(f"| {stage} | {params[stage]:,} | {info['step']:,} | {sc['batch']} x {sc['seq_len']} | "
              f"{info['tokens']:,} | {info['wall_s'] / 60:.1f} min | {bpb} | {acc} |")
    total = sum(info["wall_s"] for info in tr["stages"].values())
    print(f"\nTotal training wall time: {total / 60:.1f} min.")
    return 0


def _params(path: pathlib.Path) -> dict:
    import jax

    from specjax.checkpoint import load_model

    b = load_model(path)
    n = lambda t: sum(x.size for x in jax.tree.leaves(t))  # noqa: E731
    mtp, block = n(b.model.params["mtp"]), n(b.model.params.get("block", {}))
    return {"target": n(b.model.params) - mtp - block, "mtp": mtp, "block": block,
            "draft": n(b.draft_model.params) if b.draft_model else 0}


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
