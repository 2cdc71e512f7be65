"""The Hopper dK/dV kernel (stages/c_optimized/hopper_bwd.py) against the tl one, on a GPU.

For each cell (dtype, D, causal) at the FlashAttention-paper setting (B·N = 16384 tokens, H·D =
2048, N = --N): every Hopper tile config's dK/dV kernel alone, the tuned tl dK/dV kernel alone (the
plan's separate-dQ form, the same work), then whole backwards in interleaved rounds: stage C's
default plan, stage C with the fastest Hopper config, and cuDNN's and FlashAttention-2's backward
(SDPA's CUDNN and FLASH backends, ``torch.autograd.grad`` of a kept forward). Before timing, each
Hopper config's gradients are compared with the tl path's (max |difference| relative to the tl
gradient's max), so a wrong kernel shows before its time does.

    python experiments/hopper_bwd.py --csv results/h200/experiments/<date>_hopper_bwd.csv
    python experiments/hopper_bwd.py --D 128 --causal yes --N 8192
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import stages  # noqa: E402,F401
import torch  # noqa: E402
import triton.testing  # noqa: E402

from stages.c_optimized import backward as bwd  # noqa: E402
from stages.c_optimized.configs import device_arch  # noqa: E402
from stages.c_optimized.tune_backward import _inputs, ws_candidates  # noqa: E402

ROUNDS = 5


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60)


def launches(tensors, causal, ws=None):
    q, k, v, o, lse, do = tensors
    B, Hq, Nq, D = q.shape
    delta = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    dk, dv, dq = torch.empty_like(k), torch.empty_like(v), torch.empty_like(q)
    plan = bwd.backward_plan(D, q.dtype, 90, causal, deterministic=True)
    out = bwd.plan_backward(do, q, k, v, o, lse, delta, dq, dk, dv, None, causal=causal, scale=D ** -0.5,
                            arch=90, deterministic=True, config=plan.dkdv, dq_config=plan.dq, ws=ws)
    return out, (dq, dk, dv)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--D", default="64,128")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)
    if device_arch(torch.device("cuda")) != 90:
        print("needs an sm_90 GPU", file=sys.stderr)
        return 2
    rows = []
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    for dtype_name in args.dtype.split(","):
        for D in (int(d) for d in args.D.split(",")):
            for causal in causals:
                tensors = _inputs(dtype_name, D, causal, args.N)
                q, k, v, o, lse, do = tensors
                B, H, N = q.shape[0], q.shape[1], q.shape[2]
                flops = 2.5 * 4.0 * B * H * N * N * D / (2 if causal else 1)
                dkdv_flops = flops * 4 / 5  # four of the five products
                cell = dict(dtype=dtype_name, D=D, causal=int(causal), N=N, B=B, H=H)
                tl_launches, tl_grads = launches(tensors, causal)
                for launch in tl_launches:
                    launch.run()
                tl_ms = bench(tl_launches[1].run)
                rows.append({**cell, "kind": "dkdv", "config": "tl:" + str(bwd.backward_plan(D, q.dtype, 90, causal, deterministic=True).dkdv),
                             "ms": round(tl_ms, 4), "tflops": round(dkdv_flops / tl_ms * 1e-9, 1), "max_rel_diff": 0.0,
                             "status": "ok"})
                print(f"{dtype_name} D{D} causal{int(causal)} N{N}: tl dK/dV {tl_ms:.3f} ms "
                      f"({dkdv_flops / tl_ms * 1e-9:.0f} TFLOPS)", flush=True)
                best = None
                for ws in ws_candidates(D, q.element_size()):
                    try:
                        ws_launches, ws_grads = launches(tensors, causal, ws)
                        for launch in ws_launches:
                            launch.run()
                        torch.cuda.synchronize()
                        diff = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                                   for a, b in zip(ws_grads[1:], tl_grads[1:]))
                        ms = bench(ws_launches[1].run)
                        status = "ok" if diff < 0.05 else "wrong"
                    except Exception as e:  # noqa: BLE001 - a config that fails is recorded, the rest go on
                        ms, diff, status = None, None, f"error: {type(e).__name__}: {str(e)[:120]}"
                    rows.append({**cell, "kind": "dkdv", "config": str(ws), "ms": round(ms, 4) if ms else "",
                                 "tflops": round(dkdv_flops / ms * 1e-9, 1) if ms else "",
                                 "max_rel_diff": f"{diff:.2e}" if diff is not None else "", "status": status})
                    print(f"  {ws}: " + (f"{ms:.3f} ms ({dkdv_flops / ms * 1e-9:.0f} TFLOPS), diff {diff:.1e} {status}"
                                         if ms else status), flush=True)
                    if status == "ok" and (best is None or ms < best[0]):
                        best = (ms, ws)
                # Whole backwards, interleaved rounds.
                scale = D ** -0.5
                fns = {"c_default": lambda: bwd.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale)}
                if best is not None:
                    ws = best[1]
                    fns["c_ws"] = lambda: bwd.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale,
                                                                 ws_config=ws)
                from torch.nn.attention import SDPBackend, sdpa_kernel

                for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
                    with sdpa_kernel([backend]):
                        oo = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
                    fns[name] = (lambda oo=oo, qq=qq, kk=kk, vv=vv:
                                 torch.autograd.grad(oo, (qq, kk, vv), do, retain_graph=True))
                samples = {n: [] for n in fns}
                for _ in range(ROUNDS):
                    for n, fn in fns.items():
                        samples[n].append(bench(fn))
                for n, t in samples.items():
                    ms = statistics.median(t)
                    rows.append({**cell, "kind": "whole", "config": n if n != "c_ws" else f"c_ws:{best[1]}",
                                 "ms": round(ms, 4), "tflops": round(flops / ms * 1e-9, 1), "max_rel_diff": "",
                                 "status": "ok"})
                print("  whole: " + ", ".join(f"{n} {statistics.median(t):.3f} ms "
                                              f"({flops / statistics.median(t) * 1e-9:.0f} TFLOPS)"
                                              for n, t in samples.items()), flush=True)
                if args.csv:
                    with open(args.csv, "w", newline="") as f:
                        w = csv.DictWriter(f, fieldnames=list(rows[0]))
                        w.writeheader()
                        w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
