"""``specjax train-mtp`` on the Llama fixture, shared by the MTP training tests."""

import contextlib
import io
import json
import shutil

import numpy as np
from paths import FIXTURES

from specjax import cli

FIX = FIXTURES / "hf"
LINES = ["def parse_args(argv):", "    return parser.parse_args(argv)", "import os, sys", "class Engine:",
         "for i in range(10):", "    print(i * 2)", "if __name__ == '__main__':", "    main()"]


def data_files(tmp_path, n=2):
    files = []
    for i in range(n):
        f = tmp_path / f"data{i}.py"
        rng = np.random.default_rng(i)
        f.write_text("\n".join(LINES[j] for j in rng.integers(0, len(LINES), 120)) + "\n")
        files.append(f)
    return files


def train_cli(tmp, steps: int, *extra: str):
    """``specjax train-mtp`` into a copy of the Llama fixture under ``tmp`` (the module goes *into*
    it), checkpoints every ``steps // 2``: (checkpoint, data files, the JSON summary)."""
    ckpt = tmp / "llama"
    shutil.copytree(FIX / "llama", ckpt)
    data = data_files(tmp)
    out = io.StringIO()
    half = str(steps // 2)
    with contextlib.redirect_stdout(out):
        rc = cli.main(["train-mtp", "--model", str(ckpt), "--data", *map(str, data), "--out", str(ckpt), "--steps",
                       str(steps), "--batch", "4", "--seq-len", "24", "--lr", "1e-2", "--eval-every", half,
                       "--ckpt-every", half, *extra, "--json"])
    assert rc == 0
    return ckpt, data, json.loads(out.getvalue())
