"""What fused dQ's two passes around the dK/dV kernel cost: the pre-pass that zeroes the fp32 accumulator
and the cast that turns it into dQ.

Stage C's default Hopper backward adds dQ inside the dK/dV kernel (fused dQ) into an fp32 accumulator
shaped like Q. So the accumulator must be zeroed first (the Δ pre-pass writes the zeros beside Δ =
rowsum(dO ∘ O)) and cast to the input dtype after (one elementwise kernel): at B·N = 16384 and H·D =
2048 the accumulator is 134 MB, written once by the zeroing, read once by the cast. cuDNN's backward
does the same (``compute_dot_do_o`` and ``convert_dq_to_16bits`` beside its main kernel), so the two
passes cost both the same; what they are worth is what a kernel that needs neither could save. This
times, per cell, in interleaved rounds:

* ``backward``: stage C's whole backward (``attention_backward`` given a saved forward);
* ``kernels``: its Δ pre-pass and dK/dV kernel alone, no cast (the layout's kept launches);
* ``dkdv``: the dK/dV kernel alone;
* ``delta``: the Δ pre-pass with the zeroing; ``delta_no_zero``: the pre-pass without it (as the
  two-kernel plan runs it);
* ``cast``: the fp32 accumulator cast to the input dtype, as ``attention_backward`` does it;
* ``cudnn``: SDPA's CUDNN backend's backward (``torch.autograd.grad`` of a kept forward).

So ``backward`` − ``dkdv`` − ``delta_no_zero`` is what zeroing and casting cost the default plan, and
``cudnn`` / (``dkdv`` + ``delta_no_zero``) is how far a backward without them could go (an upper bound:
a kernel that writes dQ in the input dtype still writes those bytes once).

    python experiments/dq_passes.py --csv results/<gpu>/experiments/<date>_dq_passes.csv
    python experiments/dq_passes.py --cells grid-d128-n1024,grid-d64-n1024 --rounds 3
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from experiments.bwd_persistent import CELLS, cell_inputs, medians_in_turns, parse_cell_arguments  # noqa: E402

PARTS = ("backward", "kernels", "dkdv", "delta", "delta_no_zero", "cast", "cudnn")


def main(argv=None) -> int:
    args = parse_cell_arguments(__doc__, argv, "dq_passes.py")
    if args is None:
        return 2
    from stages.c_optimized import backward as bwd
    from stages.c_optimized.tune_backward import _write_csv

    rows: list[dict] = []
    for name in args.cells.split(","):
        B, Hq, Hkv, N, D, dtype_name, causal = CELLS[name]
        q, k, v, o, lse, do, scale, cudnn = cell_inputs(CELLS[name])

        def backward():
            return bwd.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale)

        bwd._KEPT.clear()
        backward()
        (layout, ) = bwd._KEPT.values()  # (this cell's layout, as the call kept it)
        plan = bwd.backward_plan(D, q.dtype, 90, causal)
        if layout.separate or len(layout.launches) != 2:
            print(f"{name}: the default plan ({plan}) has no fused dQ here: nothing to time", flush=True)
            rows.append(dict(cell=name, B=B, Hq=Hq, Hkv=Hkv, N=N, D=D, dtype=dtype_name, causal=int(causal),
                             plan=str(plan), part="", ms="", status="no fused dQ in the default plan"))
            continue
        tensors = bwd._allocate(q, k, v, False)
        tensors.update(do=do, q=q, k=k, v=v, o=o, lse=lse, key_starts=None, key_lengths=None)
        delta_launch, dkdv_launch = layout.launches
        # The pre-pass as the two-kernel plan plans it: Δ only, no accumulator to zero.
        spare = torch.empty_like(q)
        no_zero = bwd.plan_backward(do, q, k, v, o, lse, tensors["delta"], spare, torch.empty_like(k),
                                    torch.empty_like(v), None, causal=causal, scale=scale, arch=90,
                                    deterministic=True)[0]
        fns = {"backward": backward,
               "kernels": lambda: (delta_launch(tensors), dkdv_launch(tensors)),
               "dkdv": lambda: dkdv_launch(tensors),
               "delta": lambda: delta_launch(tensors),
               "delta_no_zero": no_zero.run,
               "cast": lambda: tensors["dq_acc"].to(q.dtype),
               "cudnn": cudnn}
        ms = medians_in_turns(fns, args.rounds)
        for part in PARTS:
            rows.append(dict(cell=name, B=B, Hq=Hq, Hkv=Hkv, N=N, D=D, dtype=dtype_name, causal=int(causal),
                             plan=str(plan), part=part, ms=round(ms[part], 4), status="ok"))
        passes = ms["backward"] - ms["dkdv"] - ms["delta_no_zero"]
        print(f"{name} ({plan}): " + ", ".join(f"{p} {ms[p]:.4f}" for p in PARTS)
              + f" ms; zeroing and cast {passes:.4f} ms ({passes / ms['backward']:.1%} of the backward); "
              f"C / cuDNN {ms['cudnn'] / ms['backward']:.3f}, without them {ms['cudnn'] / (ms['dkdv'] + ms['delta_no_zero']):.3f}",
              flush=True)
        _write_csv(args.csv, rows)  # after every cell: a crash keeps what was measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
