"""Named suites of cells: the shapes real models run, beside the FlashAttention-paper grid.

The grid of ``sweep`` (B·N = 16k tokens, H·D = 2048) is where stage C was tuned; a suite asks
whether what was learned there holds on the shapes people use: small batches of short sequences
(where the host path and the number of work items set the pace), grouped-query attention, head
dims that are not powers of two, a query block against a longer cache (chunked prefill) and
single-query decode steps against a long cache.

``python -m harness sweep --suite models`` measures every cell of :data:`SUITES` ``["models"]``;
its rows go to ``results/<gpu>/models/runs.csv`` with the cell's name in the ``cell`` column.
The cells are GPU-sized (up to 65,536 × 65,536 keys per head), far beyond what the Triton
interpreter runs in reasonable time, so on a CPU the command refuses rather than scaling the cells
down (a shrunken "llama3-8b" would not be the shape its name promises). ``--suite smoke`` has the
same kinds of shape at interpreter sizes and runs anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SuiteCell:
    """One named problem: what model (or situation) it stands for, and its shape."""

    name: str
    B: int
    Hq: int
    Hkv: int
    Nq: int
    Nk: int
    D: int
    causal: bool
    dtype: str


def _cell(name: str, B: int, Hq: int, Hkv: int, Nq: int, Nk: int, D: int, causal: str, dtype: str) -> SuiteCell:
    return SuiteCell(name, B, Hq, Hkv, Nq, Nk, D, causal == "yes", dtype)


#: The model-shape suite, cell by cell:
#: name, B, Hq, Hkv, Nq, Nk, D, causal, dtype.
MODELS: tuple[SuiteCell, ...] = (
    _cell("gpt2", 32, 12, 12, 1024, 1024, 64, "yes", "bf16"),
    _cell("bert-base", 64, 12, 12, 512, 512, 64, "no", "fp16"),
    _cell("vit-l", 32, 16, 16, 257, 257, 64, "no", "fp16"),
    _cell("llama2-7b", 4, 32, 32, 2048, 2048, 128, "yes", "bf16"),
    _cell("llama3-8b", 1, 32, 8, 8192, 8192, 128, "yes", "bf16"),
    _cell("long-context", 1, 32, 32, 65536, 65536, 128, "yes", "bf16"),
    _cell("few-heads", 2, 2, 2, 8192, 8192, 64, "no", "fp16"),
    _cell("gemma-d256", 1, 16, 16, 8192, 8192, 256, "yes", "bf16"),
    _cell("phi-d96", 8, 32, 32, 2048, 2048, 96, "yes", "fp16"),
    _cell("vit-h-d80", 16, 16, 16, 1024, 1024, 80, "no", "fp16"),
    _cell("d32", 16, 16, 16, 4096, 4096, 32, "no", "fp16"),
    _cell("odd-n", 3, 20, 20, 1500, 1500, 64, "yes", "fp16"),
    _cell("short", 128, 16, 16, 128, 128, 64, "no", "fp16"),
    _cell("tiny", 1, 1, 1, 64, 64, 64, "yes", "fp16"),
    _cell("chunked-prefill", 1, 32, 8, 512, 16384, 128, "yes", "bf16"),
    _cell("decode-gqa", 16, 32, 8, 1, 8192, 128, "no", "bf16"),
    _cell("decode-long", 4, 32, 32, 1, 32768, 128, "no", "fp16"),
)

#: The same kinds of shape at sizes the Triton interpreter runs in seconds (a CPU check of the
#: suite machinery, and a learner's first look at GQA, a KV cache and decode through the harness).
SMOKE: tuple[SuiteCell, ...] = (
    _cell("gqa", 1, 4, 2, 32, 32, 16, "yes", "fp16"),
    _cell("chunked-prefill", 1, 2, 1, 16, 48, 32, "yes", "fp16"),
    _cell("decode", 2, 4, 1, 1, 64, 16, "no", "fp16"),
    _cell("d80", 1, 2, 2, 24, 24, 80, "no", "fp16"),
)

#: every suite by name (``sweep --suite NAME``), with one line of help each
SUITES: dict[str, tuple[SuiteCell, ...]] = {"models": MODELS, "smoke": SMOKE}
SUITE_HELP: dict[str, str] = {
    "models": f"{len(MODELS)} model shapes (GPU only): GPT-2, BERT, ViT, Llama 2/3, GQA, head dims 80/96/256, "
              f"chunked prefill, decode",
    "smoke": f"{len(SMOKE)} of the same kinds of shape at interpreter sizes (runs on a CPU)",
}
#: suites too large for the Triton interpreter: ``sweep`` refuses them without a GPU
GPU_SIZED: frozenset[str] = frozenset({"models"})


def named_cells(names: str, suite: str = "models") -> list[SuiteCell]:
    """The cells of ``suite`` named in ``names`` (comma-separated), in that order: what an experiment's
    ``--cells`` takes. A ValueError names the unknown ones and the choices."""
    cells = {c.name: c for c in SUITES[suite]}
    wanted = [n for n in names.split(",") if n]
    unknown = [n for n in wanted if n not in cells]
    if unknown:
        raise ValueError(f"unknown cell(s) {', '.join(unknown)}; choose from {', '.join(cells)}")
    return [cells[n] for n in wanted]


def suite_cells(name: str, passes: tuple[str, ...] | list[str] = ("fwd",)) -> list:
    """The suite's cells as :class:`harness.results.Cell` (one per cell and pass), named."""
    from .results import Cell

    if name not in SUITES:
        raise KeyError(f"unknown suite {name!r}; suites: {', '.join(SUITES)}")
    return [Cell(c.B, c.Hq, c.Nq, c.D, c.dtype, c.causal, c.Hkv, c.Nk, pass_, c.name)
            for c in SUITES[name] for pass_ in passes]
