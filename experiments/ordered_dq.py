"""What a deterministic backward costs, two ways: dQ by a kernel of its own, or fused dQ added in a fixed order.

Stage C's default backward adds dQ inside the Hopper dK/dV kernel (fused dQ: five products per tile
pair), by bulk reduces whose order between programs is left to the GPU, so dQ's last bits vary from run
to run. ``deterministic=True`` has so far run the tuner's fastest plan without fused dQ: a dQ kernel of
its own that recomputes the scores (seven products per pair). Ordered dQ (``backward.ORDERED_DQ``,
``LAB_ORDERED_DQ=1`` makes it the deterministic plan where fused dQ is the default) keeps fused dQ and
gives each Q tile's adds a fixed order: each add waits at a semaphore in global memory for the programs
before it, as FlashAttention-3's deterministic backward does; the consumers take those turns themselves
("ordered"), or a dQ-writer warp takes them (``hopper_bwd.ORDERED_DQ_WRITER``) with one stage buffer per
consumer ("ordered-writer") or two where they fit ("ordered-writer-2", ``hopper_bwd.DQ_WRITER_BUFFERS``), or
one writer warp per column slice where each consumer adds its own columns ("ordered-writer-per-slice",
``hopper_bwd.DQ_WRITER_PER_SLICE``: at D 64 the same kernel as "ordered-writer").

For each cell, stage C's whole backward (``bwd.attention_backward`` given a saved forward) five ways,
the default plan, deterministic as tuned, deterministic with ordered dQ with and without the writer, timed
in interleaved rounds beside cuDNN's backward (SDPA's CUDNN backend, ``torch.autograd.grad`` of a kept
forward). First each deterministic way's gradients against the default's, and its bits over three runs.

    python experiments/ordered_dq.py --csv results/<gpu>/experiments/<date>_ordered_dq.csv
    python experiments/ordered_dq.py --cells grid-d64-n4096,grid-d64-n16384-causal
    python experiments/ordered_dq.py --head-by-head   # and ordered dQ on a grid run head by head (no mask)
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from experiments.bwd_persistent import CELLS, cell_inputs, parse_cell_arguments  # noqa: E402  (the same cells)
#: (name, deterministic, ordered dQ as the deterministic plan, a head's K/V tiles spread apart in the grid,
#: the turns taken by a dQ-writer warp rather than by the consumers: 0 no, else its stage buffers per consumer,
#: ``hopper_bwd.DQ_WRITER_BUFFERS``, taken where they fit; None: as the modules say, so "deterministic" is the
#: plan a deterministic backward runs, ordered dQ with the writer where the tuned table names ordered dQ;
#: -1: one buffer and a writer warp per column slice, ``hopper_bwd.DQ_WRITER_PER_SLICE``, where D is above 64)
WAYS = (("default", False, False, True, None), ("deterministic", True, False, True, None),
        ("ordered", True, True, True, 0), ("ordered-writer", True, True, True, 1),
        ("ordered-writer-2", True, True, True, 2), ("ordered-writer-per-slice", True, True, True, -1))
#: ``--head-by-head``: ordered dQ without a mask also on a grid that runs one head after another
HEAD_BY_HEAD = ("ordered-head-by-head", True, True, False, 0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def main(argv=None) -> int:
    args = parse_cell_arguments(__doc__, argv, "ordered_dq.py", lambda ap: ap.add_argument(
        "--head-by-head", action="store_true",
        help="also ordered dQ on a grid that runs one head after another (cells without a mask)"))
    if args is None:
        return 2
    import triton.testing

    from stages.c_optimized import backward as bwd
    from stages.c_optimized.tune_backward import _write_csv

    from stages.c_optimized import hopper_bwd

    default, spread_default, writer_default, buffers_default, per_slice_default = (
        bwd.ORDERED_DQ_DEFAULT, hopper_bwd.ORDERED_DQ_SPREAD, hopper_bwd.ORDERED_DQ_WRITER, hopper_bwd.DQ_WRITER_BUFFERS,
        hopper_bwd.DQ_WRITER_PER_SLICE)
    rows: list[dict] = []
    for name in args.cells.split(","):
        B, Hq, Hkv, N, D, dtype_name, causal = CELLS[name]
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
        q, k, v, o, lse, do, scale, cudnn = cell_inputs(CELLS[name])
        ways = WAYS + ((HEAD_BY_HEAD, ) if args.head_by_head and not causal else ())

        def switch(ordered, spread=True, writer=None, buffers=None):
            bwd.ORDERED_DQ_DEFAULT = ordered
            hopper_bwd.ORDERED_DQ_SPREAD = spread
            hopper_bwd.ORDERED_DQ_WRITER = writer_default if writer is None else bool(writer)
            hopper_bwd.DQ_WRITER_PER_SLICE = per_slice_default if writer is None else writer == -1
            hopper_bwd.DQ_WRITER_BUFFERS = buffers or (writer if writer and writer > 0 else buffers_default)
            bwd.backward_plan.cache_clear()
            bwd._KEPT.clear()  # (a layout planned under the other setting)

        def backward(det):
            return lambda: bwd.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale, deterministic=det)

        status, plans, ref = {}, {}, None
        for way, det, ordered, spread, writer in ways:
            switch(ordered, spread, writer)
            plans[way] = str(bwd.backward_plan(D, dtype, 90, causal, deterministic=det))
            try:
                grads = backward(det)()
                torch.cuda.synchronize()
                ref = grads if ref is None else ref
                diff = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                           for a, b in zip(grads, ref))
                status[way] = "ok" if diff < 0.02 else f"wrong: max relative difference {diff:.2e}"
                if status[way] == "ok" and det:
                    again = [backward(det)() for _ in range(2)]
                    if not all(torch.equal(_bits(a), _bits(b)) for run in again for a, b in zip(grads, run)):
                        status[way] = "not deterministic: the bits differ between runs"
            except Exception as e:  # noqa: BLE001 - a way that fails is recorded, the others go on
                status[way] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        timed = [w for w in ways if status[w[0]] == "ok"]
        samples = {w[0]: [] for w in timed} | {"cudnn": []}
        for _ in range(args.rounds):
            for way, det, ordered, spread, writer in timed:
                switch(ordered, spread, writer)
                backward(det)()  # (plans and binds the layout outside the timing)
                samples[way].append(triton.testing.do_bench(backward(det), warmup=10, rep=60))
            samples["cudnn"].append(triton.testing.do_bench(cudnn, warmup=10, rep=60))
        switch(default, spread_default, None, buffers_default)
        cudnn_ms = statistics.median(samples["cudnn"])
        ms = {w[0]: statistics.median(samples[w[0]]) for w in timed}
        for way, det, ordered, spread, writer in ways:
            t = ms.get(way)
            base = ms.get("default")
            rows.append(dict(cell=name, B=B, Hq=Hq, Hkv=Hkv, N=N, D=D, dtype=dtype_name, causal=int(causal),
                             way=way, plan=plans[way], ms=round(t, 4) if t else "", cudnn_ms=round(cudnn_ms, 4),
                             c_over_cudnn=round(cudnn_ms / t, 3) if t else "",
                             cost_over_default=round(t / base - 1, 3) if t and base else "", status=status[way]))
        print(f"{name}: cuDNN {cudnn_ms:.3f} ms; " + ", ".join(
            f"{r['way']} {r['ms'] or r['status']} (+{r['cost_over_default']})" for r in rows if r["cell"] == name),
            flush=True)
        _write_csv(args.csv, rows)  # after every cell: a crash keeps what was measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
