"""Editable copies of the checkpoint fixtures (``tests/fixtures/hf`` by default, or the drafter
folders), shared by the loader tests."""

import json
import shutil

from paths import FIXTURES

FIX = FIXTURES / "hf"


def copy_fixture(tmp_path, arch="llama", source=FIX):
    """An editable copy of fixture folder ``source / arch`` under ``tmp_path``."""
    d = tmp_path / arch
    shutil.copytree(source / arch, d)
    return d


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
