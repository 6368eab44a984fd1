"""The quickstart notebook runs top to bottom on the bundled model (nbclient)."""

from __future__ import annotations

import pathlib
import time

import nbformat
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_executes():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any(o.output_type == "display_data" and "image/png" in o.data for o in outputs)  # the plot
    print(f"notebook executed in {time.perf_counter() - t0:.1f}s")
