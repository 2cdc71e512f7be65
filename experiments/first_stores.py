"""Ordered dQ whose first add of each tile stores (``hopper_bwd.ORDERED_DQ_FIRST_STORES``) against ordered dQ
that adds into an accumulator the Δ pre-pass has zeroed.

Fused dQ adds every K/V tile's share of a Q tile's dQ into an fp32 accumulator, so the accumulator starts at
zero: the Δ pre-pass writes four bytes of zeros per element of Q before the dK/dV kernel runs (134 MB at the
FlashAttention-paper sizes, B·N = 16384 and H·D = 2048). Ordered dQ adds in a fixed order, so it knows which
add comes first, and that one can store instead; the pre-pass then zeroes only the semaphores (and rows no
K/V tile sees). For each cell, in interleaved rounds: stage C's default backward, its deterministic backward
with ordered dQ as it was and with the first add storing, and cuDNN's backward; first the gradients of the
storing one against the other's, and its bits over three runs.

    python experiments/first_stores.py --csv results/<gpu>/experiments/<date>_first_stores.csv
    python experiments/first_stores.py --cells grid-d64-n1024,gpt2 --rounds 3
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from experiments.bwd_persistent import CELLS, cell_inputs, parse_cell_arguments  # noqa: E402  (the same cells)

#: (name, deterministic, ordered dQ as the deterministic plan, its first add storing)
WAYS = (("default", False, False, False), ("ordered", True, True, False), ("ordered-first-stores", True, True, True))


def main(argv=None) -> int:
    args = parse_cell_arguments(__doc__, argv, "first_stores.py")
    if args is None:
        return 2
    import triton.testing

    from stages.c_optimized import backward as bwd
    from stages.c_optimized import hopper_bwd
    from stages.c_optimized.tune_backward import _write_csv

    saved = (hopper_bwd.ORDERED_DQ_FIRST_STORES, bwd.ORDERED_DQ_DEFAULT)

    def switch(ordered: bool, first_stores: bool) -> None:
        bwd.ORDERED_DQ_DEFAULT = ordered
        hopper_bwd.ORDERED_DQ_FIRST_STORES = first_stores
        bwd._KEPT.clear()  # (a layout planned under the other setting)

    rows: list[dict] = []
    try:
        for name in args.cells.split(","):
            B, Hq, Hkv, N, D, dtype_name, causal = CELLS[name]
            q, k, v, o, lse, do, scale, cudnn = cell_inputs(CELLS[name])

            def backward(det):
                return lambda: bwd.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale,
                                                      deterministic=det)

            status, grads = {}, {}
            for way, det, ordered, first in WAYS:
                switch(ordered, first)
                try:
                    runs = [backward(det)() for _ in range(3)]
                    torch.cuda.synchronize()
                    grads[way] = runs[0]
                    same = all(torch.equal(a, b) for run in runs[1:] for a, b in zip(run, runs[0]))
                    status[way] = "ok" if same or not det else "not reproducible"
                except Exception as e:  # noqa: BLE001 - a way that fails is recorded, the others go on
                    status[way] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            if status.get("ordered-first-stores") == "ok" and "ordered" in grads:
                diff = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                           for a, b in zip(grads["ordered-first-stores"], grads["ordered"]))
                if diff > 0.02:
                    status["ordered-first-stores"] = f"wrong: max relative difference {diff:.2e} to 'ordered'"
            timed = [w for w in WAYS if status[w[0]] == "ok"]
            samples = {w[0]: [] for w in timed}
            samples["cudnn"] = []
            for _ in range(args.rounds):
                for way, det, ordered, first in timed:
                    switch(ordered, first)
                    backward(det)()  # (plans and binds the layout outside the timing)
                    samples[way].append(triton.testing.do_bench(backward(det), warmup=10, rep=60))
                samples["cudnn"].append(triton.testing.do_bench(cudnn, warmup=10, rep=60))
            ms = {w: statistics.median(x) for w, x in samples.items() if x}
            for way, *_ in WAYS:
                t = ms.get(way)
                rows.append(dict(cell=name, B=B, Hq=Hq, Hkv=Hkv, N=N, D=D, dtype=dtype_name, causal=int(causal),
                                 way=way, ms=round(t, 4) if t else "", cudnn_ms=round(ms["cudnn"], 4),
                                 c_over_cudnn=round(ms["cudnn"] / t, 3) if t else "",
                                 over_default=round(t / ms["default"], 3) if t and "default" in ms else "",
                                 status=status[way]))
            print(f"{name}: cuDNN {ms['cudnn']:.3f} ms; " + ", ".join(
                f"{r['way']} {r['ms'] or r['status']} ({r['over_default']}x default)" for r in rows
                if r["cell"] == name), flush=True)
            _write_csv(args.csv, rows)  # after every cell: a crash keeps what was measured
    finally:
        hopper_bwd.ORDERED_DQ_FIRST_STORES, bwd.ORDERED_DQ_DEFAULT = saved
        bwd._KEPT.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
