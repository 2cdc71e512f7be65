"""experiments/walk_locality.py's model of the backward's L2 (performance-log entry 101) against what it
must give at its two ends: an L2 that holds every line reads each line once, one that holds a single
line reads it at every meeting; and either walk meets the same tiles, only in another order."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest

from stages.contract import cdiv

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "walk_locality.py"
CELL = (1, 4, 2, 1000, 1300, 64, 2)  # (B, Hq, Hkv, Nq, Nk, D, bytes): grouped, Nq ≠ Nk, ragged tiles


@pytest.fixture(scope="module")
def model():
    spec = importlib.util.spec_from_file_location("walk_locality", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def meetings(model, walk):
    B, Hq, Hkv, Nq, Nk, D, _ = CELL
    return model.accesses(B, Hq, Hkv, Nq, Nk, 128, 64, 132, walk, 2)


def test_both_walks_meet_the_same_tiles_in_another_order(model):
    (up, programs), (down, programs_down) = meetings(model, "up"), meetings(model, "down")
    assert programs == programs_down == 2 * cdiv(CELL[4], 128)
    assert Counter((h, t) for _, h, t in up) == Counter((h, t) for _, h, t in down)
    assert [(h, t) for _, h, t in up] != [(h, t) for _, h, t in down]
    # Causal, bottom-right: a K/V tile starting at key n meets the Q tiles from the one holding row n - (Nk - Nq).
    B, Hq, Hkv, Nq, Nk, D, _ = CELL
    expected = sum(Hq // Hkv * (cdiv(Nq, 64) - max(n * 128 - (Nk - Nq), 0) // 64) for n in range(cdiv(Nk, 128)))
    assert len(up) == Hkv * expected


@pytest.mark.parametrize("walk", ["up", "down"])
def test_the_model_reads_each_line_once_or_at_every_meeting(model, walk):
    B, Hq, Hkv, Nq, Nk, D, e = CELL
    line = 64 * (2 * D * e + 8) + 64 * D * 4  # Q, dO, the row statistics and the fp32 dQ rows of a Q tile
    met, programs = meetings(model, walk)
    kv = 2 * programs * 128 * D * e
    lines = len({(h, t) for _, h, t in met})
    assert model.dram_bytes(CELL, walk=walk, l2_mb=1e4) == (lines * line + kv, kv)
    # Room for one line: a meeting hits only where the meeting before it (in time) was of the same line,
    # and every line read is evicted again, but the last, its fp32 dQ rows written back.
    misses = changes(met)
    assert model.dram_bytes(CELL, walk=walk, l2_mb=1.5 * line / 2**20) == (misses * line + kv,
                                                                           (misses - 1) * 64 * D * 4 + kv)


def changes(met) -> int:
    """Meetings whose line differs from the meeting's before it in time: a one-line cache's misses."""
    return sum(1 for i, (_, h, t) in enumerate(met) if i == 0 or met[i - 1][1:] != (h, t))


def test_walking_down_the_programs_of_a_head_meet_a_tile_in_step(model):
    """What the walk down is for: the programs of a head that start together meet each tile at the same
    step, so even a one-line cache serves some of them; walking up, each meets it at its own time. (The
    whole kernel's bytes at a real L2 are another matter: entry 101.)"""
    assert changes(meetings(model, "down")[0]) < changes(meetings(model, "up")[0])


def test_the_cli_names_a_bad_argument(model, capsys):
    with pytest.raises(SystemExit) as exit_:
        model.main(["--l2-mb", "0,40"])
    assert exit_.value.code == 2 and "--l2-mb" in capsys.readouterr().err
    assert model.main(["--cells", "nope"]) == 2
    assert "unknown cell 'nope'" in capsys.readouterr().err
