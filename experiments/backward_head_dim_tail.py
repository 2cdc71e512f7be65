"""The backward at a head dim past a power of two: pad it, or run a narrow tail? On a GPU.

Stage C's Hopper backward kernels (``hopper_bwd.py``) run D 72-96 either in tiles of 128 columns
(``-pad`` configs: what ran before the tail, 1.3-1.8 times the multiply-adds) or as 64 columns and a
tail of 16 or 32 (``hopper_bwd.tile_widths``), the forward's mechanism: Sᵀ and dPᵀ add the tail's
product, dK, dV and dQ each get a tail accumulator. For every head dim given, at the
FlashAttention-paper sizes (B·N = 16384 tokens, H = 2048 // D), whole backwards (``torch.autograd.grad``
of a kept forward for SDPA; stage C's backward given its saved forward), timed in turns
(``ab.time_in_turns``, ``do_bench`` samples):

* ``padded``: the plan tuned at the padded width (128) with its kernels forced to ``-pad``;
* ``tail``: stage C's default plan now (the tail, with the tiles tuned at the tail's width when there
  are some: ``tune_backward --hopper --D 80,96``);
* ``cudnn`` and ``flash``: SDPA's cuDNN and FlashAttention-2 backends.

Each variant's gradients are compared with cuDNN's first (``max_rel_diff``: the largest |difference|
over cuDNN's largest |gradient|, the worst of dQ, dK, dV).

    python experiments/backward_head_dim_tail.py --csv results/h200/experiments/<date>_backward_head_dim_tail.csv
    python experiments/backward_head_dim_tail.py --D 80 --dtype fp16 --causal no --csv <file>
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import stages  # noqa: E402,F401
import torch  # noqa: E402

from ab import time_in_turns  # noqa: E402
from stages.c_optimized import backward as bwd  # noqa: E402
from stages.c_optimized import hopper_bwd  # noqa: E402
from stages.c_optimized.configs import device_arch  # noqa: E402
from stages.c_optimized.tune_backward import _inputs  # noqa: E402
from stages.contract import padded_head_dim  # noqa: E402

#: Every head dim whose Hopper backward runs a tail (multiples of 8).
TAIL_DIMS = tuple(D for D in range(8, 257, 8) if hopper_bwd.tile_widths(D)[1])


def _padded_plan(D: int, dtype: torch.dtype, causal: bool) -> dict:
    """The Hopper kernels the plan tuned at the padded width runs, forced to ``-pad``."""
    plan = bwd.backward_plan(padded_head_dim(D), dtype, 90, causal, deterministic=True)
    out = {}
    if plan.ws is not None:
        out["ws_config"] = replace(plan.ws, pad=True)
    if isinstance(plan.ws_dq, bwd.WsConfig):
        out["ws_dq_config"] = replace(plan.ws_dq, pad=True)
    return out


def variants(tensors, causal: bool) -> tuple[dict, dict]:
    """({name: a call returning (dq, dk, dv)}, {name: its plan in words})."""
    q, k, v, o, lse, do = tensors
    D = q.shape[-1]
    scale = D ** -0.5
    padded = _padded_plan(D, q.dtype, causal)
    fns = {"padded": lambda: bwd.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale,
                                                    deterministic=True, **padded),
           "tail": lambda: bwd.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale)}
    plans = {"padded": ",".join(str(c) for c in padded.values()),
             "tail": str(bwd.backward_plan(D, q.dtype, 90, causal))}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        with sdpa_kernel([backend]):
            oo = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
        fns[name] = (lambda oo=oo, qq=qq, kk=kk, vv=vv: torch.autograd.grad(oo, (qq, kk, vv), do, retain_graph=True))
        plans[name] = "SDPA"
    return fns, plans


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", required=True, help="rows are appended (dtype,D,causal,N,B,H,impl,plan,ms,...)")
    ap.add_argument("--D", default=",".join(map(str, TAIL_DIMS)), help="head dims (default: every one with a tail)")
    ap.add_argument("--dtype", default="bf16,fp16")
    ap.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--turns", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or device_arch(torch.device("cuda")) != 90:
        print("needs an sm_90 GPU (the Hopper backward kernels)", file=sys.stderr)
        return 2
    causals = {"no": (False, ), "yes": (True, ), "both": (False, True)}[args.causal]
    path = Path(args.csv)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = ["dtype", "D", "causal", "N", "B", "H", "impl", "plan", "ms", "tflops", "vs_cudnn", "vs_padded",
              "max_rel_diff", "status"]
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        if new:
            w.writeheader()
        for dtype in args.dtype.split(","):
            for D in (int(d) for d in args.D.split(",")):
                for causal in causals:
                    cell = {"dtype": dtype, "D": D, "causal": int(causal), "N": args.N}
                    try:
                        tensors = _inputs(dtype, D, causal, args.N)
                        q = tensors[0]
                        B, H = q.shape[0], q.shape[1]
                        flops = 2.5 * 4.0 * B * H * args.N * args.N * D / (2 if causal else 1)
                        fns, plans = variants(tensors, causal)
                        ref = [g.float() for g in fns["cudnn"]()]
                        diffs = {}
                        for name, fn in fns.items():
                            got = fn()
                            diffs[name] = max(float((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-30))
                                              for a, b in zip(got, ref))
                        ms = time_in_turns(fns, args.turns)
                        for name, t in ms.items():
                            w.writerow({**cell, "B": B, "H": H, "impl": name, "plan": plans[name], "ms": f"{t:.5f}",
                                        "tflops": f"{flops / t * 1e-9:.1f}", "vs_cudnn": f"{ms['cudnn'] / t:.4f}",
                                        "vs_padded": f"{ms['padded'] / t:.4f}", "max_rel_diff": f"{diffs[name]:.2e}",
                                        "status": "ok" if diffs[name] < 0.05 else "wrong"})
                        print(dtype, D, causal, {n: round(t, 4) for n, t in ms.items()},
                              {n: f"{d:.1e}" for n, d in diffs.items()}, flush=True)
                    except Exception as e:  # noqa: BLE001 - recorded, the other cells go on
                        w.writerow({**cell, "impl": "error",
                                    "status": f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"})
                        print(dtype, D, causal, "error:", e, flush=True)
                        torch.cuda.empty_cache()
                    f.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
