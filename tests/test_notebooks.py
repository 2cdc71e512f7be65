"""Every notebook of the teaching path runs top to bottom without an error (CPU: Triton interpreter).

Executed with nbclient in a fresh ``python3`` kernel whose working directory is ``notebooks/`` (as
Jupyter and nbmake run them). Nothing is written back: the committed outputs are refreshed by
re-executing the notebooks in place (see notebooks/README.md). The whole set takes well under a minute
on a CPU without committed GPU results; on a GPU they also time a few cases live.
"""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
CELL_TIMEOUT_S = 300


def test_reading_path_is_complete():
    numbers = [int(p.name[:2]) for p in NOTEBOOKS]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 7, [p.name for p in NOTEBOOKS]
    readme = (NOTEBOOKS_DIR / "README.md").read_text()
    for p in NOTEBOOKS:
        assert p.name in readme, f"{p.name} is missing from notebooks/README.md"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, monkeypatch):
    # Outputs are executed against the committed results/, never a developer's override.
    monkeypatch.delenv("LAB_RESULTS", raising=False)
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS_DIR)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name}: a cell failed\n{e}", pytrace=False)
    for cell in nb.cells:  # errors a cell swallowed into its output still count
        for out in cell.get("outputs", []):
            assert out.get("output_type") != "error", f"{path.name}: {out.get('ename')}: {out.get('evalue')}"
