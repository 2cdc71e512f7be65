"""Rerun ``results/h200/experiments/2026-12-01_lazy_rescale.csv``: O rescaled lazily (only when a row's
maximum grows past 2^8) against eagerly (every tile), on each cell's tuned warp-specialized config.

    python experiments/lazy_rescale.py --out results/h200/experiments/<date>_lazy_rescale.csv

GPU only (sm_90). The committed file was timed with a script on branch ``wip/lazy-rescale``; this is
the same measurement written against main's switch (``Config.lazy_rescale``, the ``-E`` configs).
The tuned configs have changed since (the tuner now keeps ``-E`` where it measured faster), so
expect the same picture, not the same digits.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()

    import stages
    from stages.c_optimized import configs

    from ab import run_ab

    c = stages.STAGES["c"]

    def variants(q, k, v, causal):
        D, N = q.shape[-1], q.shape[2]
        tuned = configs.choose_config(D, q.dtype, causal, 90, N, True)
        if not tuned.ws:
            return {}
        eager, lazy = (dataclasses.replace(tuned, lazy_rescale=flag) for flag in (False, True))
        return {"eager": lambda: c.attention(q, k, v, causal=causal, config=eager),
                "lazy": lambda: c.attention(q, k, v, causal=causal, config=lazy)}

    run_ab(args.out, variants, baseline="eager", turns=args.turns)


if __name__ == "__main__":
    main()
