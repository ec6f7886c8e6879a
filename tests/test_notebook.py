"""The quick-start notebook runs top to bottom on CPU (embedded tiny setup) and prints its metrics."""

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "notebooks" / "dhpo_quickstart.ipynb"


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    monkeypatch.setenv("DHPO_TRL_CACHE", str(tmp_path / "cache"))  # a fresh warm start: no state from other runs
    # outputs/ of the notebook land in tmp_path; a failing cell raises CellExecutionError
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(
        output.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
    )
    assert "DHPO metrics logged: ['dhpo/clip_fraction/sequence_high'" in text
    assert "final mixing weight mean: 0." in text
    assert "PUSH_TO_HUB is False: nothing uploaded." in text
    saved = tmp_path / "outputs" / "dhpo-quickstart"
    assert (saved / "model.safetensors").is_file() and (saved / "tokenizer.json").is_file()
    assert "DHPO settings" in (saved / "README.md").read_text()
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # conftest: the notebook ran offline too
