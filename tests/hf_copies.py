"""Editable copies of the Hugging Face fixtures (``tests/fixtures/hf``), shared by the loader tests."""

import json
import shutil

from paths import FIXTURES

FIX = FIXTURES / "hf"


def copy_fixture(tmp_path, arch="llama"):
    d = tmp_path / arch
    shutil.copytree(FIX / arch, d)
    return d


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
