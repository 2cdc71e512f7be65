"""The views never drop a measured energy because a later run of the same cell did not measure it."""

from __future__ import annotations

from harness import views


def _row(run_id, impl, energy=None, ms=1.0):
    return {"run_id": run_id, "impl": impl, "kind": "stage", "variant": "", "B": 1, "H": 2, "Hkv": 2,
            "N": 64, "Nk": 64, "D": 16, "dtype": "fp16", "causal": 0, "pass": "fwd", "status": "ok",
            "ms_median": ms, "energy_j_per_call": energy, "power_w": None if energy is None else 600.0}


def test_latest_row_borrows_the_energy_of_the_latest_run_that_measured_it():
    all_rows = [_row("r1", "c", energy=0.5), _row("r2", "c", energy=0.4), _row("r3", "c", ms=0.9),
                _row("r3", "b", ms=2.0)]
    latest = [all_rows[2], all_rows[3]]
    merged = {r["impl"]: r for r in views.merge_energy(latest, all_rows)}
    assert merged["c"]["ms_median"] == 0.9                     # the latest time stays
    assert merged["c"]["energy_j_per_call"] == 0.4             # the latest *measured* energy
    assert merged["c"]["energy_run_id"] == "r2"                # and which run it shows
    assert merged["b"]["energy_j_per_call"] is None            # never measured: nothing invented
    assert views.energy_runs(list(merged.values())) == ["r2"]


def test_a_row_with_its_own_energy_keeps_it():
    all_rows = [_row("r1", "c", energy=0.5), _row("r2", "c", energy=0.7)]
    (merged,) = views.merge_energy([all_rows[1]], all_rows)
    assert merged["energy_j_per_call"] == 0.7 and merged["energy_run_id"] == "r2"
