"""Lab 4: pad the shared arrays of stage B's CUDA twin, predict the bank conflicts, then count.

``stages/b_tiled/flash_b.cu`` keeps K in shared memory as ``Ks[BC][ROW]`` halves, and computes
S = Q Kᵀ with one key per lane: lane l reads row l of K at the same column d, 4 bytes (two halves) at
a time. Shared memory has 32 banks of 4 bytes; byte address a is in bank (a // 4) % 32, and a warp's
access takes as many wavefronts (passes) as the busiest bank has distinct words.

With ``ROW = D`` halves (D = 64: 128 bytes per row) every row starts in the same bank, so the 32
lanes all hit one bank: 32 wavefronts instead of 1. Your job, marked ``TODO(lab)``:

1. ``predict_column_wavefronts(row_halves)``: the wavefronts of that column read when a row is
   ``row_halves`` halves long (an even number), as a formula, without calling the bank model;
2. ``padded_row_halves(D)``: the shortest even row length >= D that makes the read conflict-free.
   (flash_b.cu's ``PAD`` template switch is your answer for D = 64 and 128.)

The check counts with ``stages/bank_model.py`` (the model the CUDA twins' Nsight Compute counts
were checked against) for every even row length up to 256 halves and for a few hundred drawn at
random up to 2^20, and asks ``padded_row_halves`` for every head dim 8 ... 256 and for random ones up
to 4096. While your two functions run, the bank model is off limits: calling anything in
``stages/bank_model.py`` fails the check (a count you asked the model for is not a prediction). It
also builds the lanes' addresses itself, so ``column_read_addresses`` is yours to use, not to edit.
No GPU needed.

    python -m labs check bank_padding
"""

from __future__ import annotations

from math import gcd  # noqa: F401  (you may want it)

BANKS = 32
BANK_BYTES = 4
HALF_BYTES = 2


def column_read_addresses(row_halves: int) -> list[int]:
    """Byte offsets the 32 lanes read: lane l reads 4 bytes at the start of row l."""
    return [lane * row_halves * HALF_BYTES for lane in range(32)]


def predict_column_wavefronts(row_halves: int) -> int:
    """Wavefronts one warp needs for the column read, rows of ``row_halves`` halves (even)."""
    # TODO(lab): a row is row_halves // 2 words; lane l's word is l * that. Which lanes share a bank?
    raise NotImplementedError("TODO(lab): predict_column_wavefronts")


def padded_row_halves(D: int) -> int:
    """The shortest even row length (halves) >= D with a conflict-free column read."""
    # TODO(lab): the fewest halves of padding; think about what predict_column_wavefronts needs.
    raise NotImplementedError("TODO(lab): padded_row_halves")
