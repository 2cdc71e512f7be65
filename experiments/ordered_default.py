"""Where ordered dQ can be the default backward: its order's start-up chain against the grid's size.

Ordered dQ (``backward.ORDERED_DQ``) adds each Q tile's dQ shares in a fixed order: K/V tile ``j`` of a
head adds after tile ``j − 1`` has. Its first add of each tile stores, so nothing zeroes the fp32
accumulator first, and on the FA grid's D 64 cells without a mask the tuner takes it over fused dQ
(adds in any order, by atomics) even where determinism is not asked for. But the order costs a chain at
the start of the kernel: the programs that start together wait for each other, one add each, before
they run in step. Spread over many (query head, Q tile) pairs per SM, as on the grid, that is a few
percent of the kernel that its saved passes pay for; over few, it is not (two heads of 8k tokens: four
heads × 128 Q tiles for 132 SMs).

This times, per cell, stage C's whole backward (``attention_backward`` given a saved forward) with the
tuned Hopper dK/dV tiles and fused dQ, then the same tiles with ordered dQ, and cuDNN's backward (SDPA's
CUDNN backend), in interleaved rounds, on cells spanning the number of (query head, Q tile) pairs per SM;
each ordered backward's gradients are first checked against the fused one's.

    python experiments/ordered_default.py --csv results/<gpu>/experiments/<date>_ordered_default.csv
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from experiments.bwd_persistent import cell_inputs, medians_in_turns, parse_cell_arguments  # noqa: E402

#: name -> (B, Hq, Hkv, N, D, dtype, causal): D 64 without a mask (where the tuner may pick ordered dQ),
#: from 3 to 62 (query head, 64-row Q tile) pairs per SM of an H100/H200
CELLS = {
    "b1-h12-n2k": (1, 12, 12, 2048, 64, "bf16", False),
    "few-heads": (2, 2, 2, 8192, 64, "fp16", False),
    "b2-h8-n4k": (2, 8, 8, 4096, 64, "bf16", False),
    "b1-h8-n8k": (1, 8, 8, 8192, 64, "bf16", False),
    "b1-h16-n8k": (1, 16, 16, 8192, 64, "bf16", False),
    "b1-h4-n32k": (1, 4, 4, 32768, 64, "bf16", False),
    "b1-h16-gqa4-n8k": (1, 16, 4, 8192, 64, "bf16", False),
    "b1-h32-n8k": (1, 32, 32, 8192, 64, "bf16", False),
    "bert-base": (64, 12, 12, 512, 64, "fp16", False),
    "grid-d64-n4096": (4, 32, 32, 4096, 64, "bf16", False),
}
WAYS = ("fused", "ordered", "cudnn")


def main(argv=None) -> int:
    args = parse_cell_arguments(__doc__, argv, "ordered_default.py", cells=CELLS, rounds=3)
    if args is None:
        return 2
    from stages.c_optimized import backward as bwd
    from stages.c_optimized.tune_backward import _write_csv

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows: list[dict] = []
    for name in args.cells.split(","):
        B, Hq, Hkv, N, D, dtype_name, causal = CELLS[name]
        q, k, v, o, lse, do, scale, cudnn = cell_inputs(CELLS[name])
        ws = bwd.backward_plan(D, q.dtype, 90, causal).ws
        ws = ws if ws is not None and bwd.ordered_dq_fits(ws) else bwd.WsConfig(64, 2, 2)
        pairs = bwd.query_tile_pairs(B, Hq, N, ws.block_m)

        def run(way):
            return bwd.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale, ws_config=ws,
                                          ws_dq_config=way)

        fused, ordered = run("fused"), run("ordered")
        diff = max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(ordered, fused))
        fns = {"fused": lambda: run("fused"), "ordered": lambda: run("ordered"), "cudnn": cudnn}
        ms = medians_in_turns(fns, args.rounds)
        for way in WAYS:
            rows.append(dict(cell=name, B=B, Hq=Hq, Hkv=Hkv, N=N, D=D, dtype=dtype_name, causal=int(causal),
                             ws=str(ws), pairs_per_sm=round(pairs / sms, 2), way=way, ms=round(ms[way], 4),
                             max_rel_diff=f"{diff:.2e}" if way == "ordered" else "",
                             status="ok" if diff < 0.02 else "wrong"))
        print(f"{name}: {pairs / sms:.1f} pairs/SM; fused {ms['fused']:.4f}, ordered {ms['ordered']:.4f} "
              f"({ms['ordered'] / ms['fused'] - 1:+.1%}), cuDNN {ms['cudnn']:.4f} ms; ordered vs fused {diff:.1e}",
              flush=True)
        _write_csv(args.csv, rows)  # after every cell: a crash keeps what was measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
