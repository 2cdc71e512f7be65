"""Every notebook of the teaching path runs top to bottom without an error (CPU: Triton interpreter).

Executed with nbclient in a fresh ``python3`` kernel whose working directory is ``notebooks/`` (as
Jupyter and nbmake run them). Nothing is written back: the committed outputs are refreshed by
re-executing the notebooks in place (see notebooks/README.md). The whole set takes a few minutes on a
2-core CPU; on a GPU they also time a few cases live. One notebook: ``pytest tests/test_notebooks.py -k 05b``
(the test ids are the notebooks' names).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS_DIR = Path(__file__).resolve().parents[1] / "notebooks"
#: ``NN_name.ipynb``, or ``NNb_name.ipynb`` for the second half of a notebook too long for one sitting
NAME = re.compile(r"(\d\d)([a-z]?)_.+\.ipynb")
NOTEBOOKS = sorted(p for p in NOTEBOOKS_DIR.glob("[0-9][0-9]*_*.ipynb") if NAME.fullmatch(p.name))
CELL_TIMEOUT_S = 300


def test_reading_path_is_complete():
    """01, 02, ... without a gap; a lettered half (05b) only beside its first half (05); every notebook
    listed in notebooks/README.md, and every notebook link there names a file."""
    keys = [NAME.fullmatch(p.name).groups() for p in NOTEBOOKS]
    numbers = sorted({int(n) for n, _ in keys})
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 7, [p.name for p in NOTEBOOKS]
    for n, letter in keys:
        assert not letter or (n, "") in keys, f"notebook {n}{letter} has no first half {n}"
    assert len(keys) == len(set(keys)), [p.name for p in NOTEBOOKS]
    readme = (NOTEBOOKS_DIR / "README.md").read_text()
    for p in NOTEBOOKS:
        assert p.name in readme, f"{p.name} is missing from notebooks/README.md"
    for link in re.findall(r"\]\(([^)#]+\.ipynb)", readme):
        assert (NOTEBOOKS_DIR / link).exists(), f"notebooks/README.md links to {link}, which does not exist"


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
