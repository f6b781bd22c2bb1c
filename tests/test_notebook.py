"""notebooks/analysis.ipynb runs top to bottom against the micro sweep's store, so it cannot rot."""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient

from tests.support import ROOT


def test_analysis_notebook_runs_against_the_micro_store(micro: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    assert micro["code"] == 0
    monkeypatch.setenv("GATED_ATTN_GRID", str(micro["grid"]))
    monkeypatch.setenv("GATED_ATTN_RESULTS", str(micro["results"]))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    notebook = nbformat.read(ROOT / "notebooks" / "analysis.ipynb", as_version=4)
    NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT / "notebooks")}},
    ).execute()  # raises CellExecutionError on the first failing cell
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 3  # Figures 1 (right), 2 (left) and 3
    text = "\n".join(str(o.get("data", {}).get("text/markdown", "")) for o in outputs)
    assert "SDPA elementwise (G1)" in text and "Gate score" in text and "F-Attn" in text
