"""Every notebook in notebooks/ executes top to bottom (tiny mode) in a real Jupyter kernel.

The kernel is this venv's python (a kernelspec written to a temporary
JUPYTER_PATH), so the notebooks see the same fthsdp as the tests. The
committed notebooks are read, executed in memory and never rewritten.
"""

import json
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


@pytest.fixture
def venv_kernel(tmp_path, monkeypatch):
    spec_dir = tmp_path / "jupyter" / "kernels" / "fthsdp-venv"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "fthsdp venv", "language": "python",
    }))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("FTHSDP_NOTEBOOK_MODE", "tiny")
    return "fthsdp-venv"


def _text(nb) -> str:
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            out.append(o.get("text", "") if o.get("output_type") == "stream" else "")
            out.append(str(o.get("data", {}).get("text/plain", "")))
    return "\n".join(out)


def test_there_is_a_notebook():
    assert NOTEBOOKS, "notebooks/ holds no .ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes_in_tiny_mode(path, venv_kernel):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name=venv_kernel,
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError with the cell's traceback on any error
    text = _text(nb)
    assert "mode tiny" in text
    if path.name == "lr_intervention.ipynb":
        # the conclusion is printed from the numbers just computed, and the plots are shown
        assert "sqrt had a lower RMS deviation from the baseline than none in" in text
        assert ("AGREES with the paper" in text) or ("DISAGREES with the paper" in text)
        images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
        assert len(images) == 2
