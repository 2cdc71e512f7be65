"""Fused dQ in the Hopper dK/dV kernel against a dQ kernel of its own, on a GPU.

The Hopper backward (stages/c_optimized/hopper_bwd.py) can form dQ two ways: a second kernel that
recomputes S and dP with Q resident (seven products per tile pair over the two kernels, no atomics,
deterministic), or inside the dK/dV kernel (``ws_dq_config="fused"``: dS goes through shared memory
into one more product, dS·K, whose tile is added to an fp32 accumulator by atomics; five products).
For each cell (dtype, D, causal; FlashAttention-paper sizes, B·N = 16384 tokens, H·D = 2048, and a
grouped-query cell) this times:

* ``dkdv``: the dK/dV kernel alone, each config fused dQ takes (``backward.fused_dq_fits``), without
  and with fused dQ (what the fusion costs the kernel);
* ``whole``: whole backwards in interleaved rounds: stage C's default plan, stage C with fused dQ at
  every such config, cuDNN's and FlashAttention-2's backward (SDPA);

after checking each fused config's gradients against the default plan's (max |difference| over the
default's max: dK and dV must agree to rounding, dQ to the atomics' summation order).

    python experiments/fused_dq.py --csv results/h200/experiments/<date>_fused_dq_pair.csv   # the default way: pair
    LAB_FUSED_DQ_ATOMICS=mma python experiments/fused_dq.py --csv results/h200/experiments/<date>_fused_dq_mma.csv
    LAB_FUSED_DQ_ATOMICS=tma python experiments/fused_dq.py --csv results/h200/experiments/<date>_fused_dq_tma.csv
    LAB_FUSED_DQ_AHEAD=1 python experiments/fused_dq.py --D 128 --gqa no   # each tile's dQ product issued a tile ahead
    python experiments/fused_dq.py --variants plain,stagger   # each program's Q tiles in its own order, and not
    python experiments/fused_dq.py --D 128 --variants plain,lag     # each tile's dQ slice formed during the next tile
    python experiments/fused_dq.py --D 128 --variants plain,compact  # row statistics spread right before use
    python experiments/fused_dq.py --D 128 --causal no --gqa no
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import stages  # noqa: E402,F401
import torch  # noqa: E402
import triton.testing  # noqa: E402

from stages.c_optimized import backward as bwd  # noqa: E402
from stages.c_optimized import hopper_bwd  # noqa: E402
from stages.c_optimized.configs import device_arch  # noqa: E402
from stages.c_optimized.tune_backward import _inputs, _write_csv, ws_candidates  # noqa: E402

ROUNDS = 5
#: --variants: the dK/dV kernel's switches, (FUSED_DQ_STAGGER, FUSED_DQ_LAG, COMPACT_ROW_STATS), by name.
#: The first two concern fused dQ only; a variant with compact row statistics also times the kernel
#: without fused dQ that way.
VARIANTS = {"plain": (False, False, False), "stagger": (True, False, False), "lag": (False, True, False),
            "stagger+lag": (True, True, False), "compact": (False, False, True),
            "compact+stagger+lag": (True, True, True)}
SWITCHES = ("FUSED_DQ_STAGGER", "FUSED_DQ_LAG", "COMPACT_ROW_STATS")


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60)


def dkdv_launch(tensors, causal: bool, ws, fused: bool):
    """The Hopper dK/dV kernel's launch alone (with its dQ accumulator when ``fused``)."""
    q, k, v, o, lse, do = tensors
    B, Hq, Nq, D = q.shape
    delta = torch.zeros((B, Hq, Nq), dtype=torch.float32, device=q.device)
    dk, dv, dq = torch.empty_like(k), torch.empty_like(v), torch.empty_like(q)
    acc = torch.zeros((B, Hq, Nq, D), dtype=torch.float32, device=q.device) if fused else None
    launches = bwd.plan_backward(do, q, k, v, o, lse, delta, dq, dk, dv, acc, causal=causal, scale=D ** -0.5,
                                 arch=90, deterministic=not fused, ws=ws, ws_dq=bwd.FUSED_DQ if fused else None)
    return launches[1]


def relative_difference(grads, ref) -> list[float]:
    return [float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
            for a, b in zip(grads, ref)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--D", default="64,128")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    ap.add_argument("--gqa", default="yes", choices=["yes", "no"],
                    help="also a grouped-query cell at D 128 (B 2, Hq 32, Hkv 8)")
    ap.add_argument("--variants", default="default",
                    help="the fused dK/dV kernel's switches to time side by side (the dkdv rows; the whole backwards "
                         "take the module's): 'default' (as the module has them), or some of "
                         f"{','.join(VARIANTS)} ('plain': all off; 'stagger': hopper_bwd.FUSED_DQ_STAGGER; 'lag': "
                         "hopper_bwd.FUSED_DQ_LAG; 'compact': hopper_bwd.COMPACT_ROW_STATS, also without fused dQ)")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or device_arch(torch.device("cuda")) != 90:
        print("fused_dq.py needs an sm_90 GPU (the Hopper backward kernels)", file=sys.stderr)
        return 2
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    cells = [(dt, int(D), c, None) for dt in args.dtype.split(",") for D in args.D.split(",") for c in causals]
    if args.gqa == "yes":
        cells += [(dt, 128, c, (2, 32, 8)) for dt in args.dtype.split(",") for c in causals]
    default = tuple(getattr(hopper_bwd, name) for name in SWITCHES)
    names = args.variants.split(",")
    unknown = [n for n in names if n != "default" and n not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)}; choose from default, {', '.join(VARIANTS)}")
    variants = [(n, default if n == "default" else VARIANTS[n]) for n in names]
    rows: list[dict] = []
    for dtype_name, D, causal, gqa in cells:
        tensors = _inputs(dtype_name, D, causal, args.N)
        if gqa is not None:
            B, Hq, Hkv = gqa
            q, k, v, o, lse, do = _inputs(dtype_name, D, causal, args.N, B=B, H=Hq)
            k, v = k[:, :Hkv].contiguous(), v[:, :Hkv].contiguous()
            from stages.c_optimized.kernels import attention_with_lse

            o, lse = attention_with_lse(q, k, v, causal=causal)
            tensors = (q, k, v, o, lse, do)
        q, k, v, o, lse, do = tensors
        B, H, N = q.shape[0], q.shape[1], q.shape[2]
        flops = 2.5 * 4.0 * B * H * N * N * D / (2 if causal else 1)
        cell = dict(dtype=dtype_name, D=D, causal=int(causal), N=N, B=B, Hq=H, Hkv=k.shape[1],
                    atomics=hopper_bwd.FUSED_DQ_ATOMICS + ("+ahead" if hopper_bwd.FUSED_DQ_AHEAD else "")
                    + ("+stagger" if default[0] else "") + ("+lag" if default[1] else "")
                    + ("+compact" if default[2] else ""))
        # (how fused dQ adds: LAB_FUSED_DQ_ATOMICS, and LAB_FUSED_DQ_AHEAD)
        scale = D ** -0.5
        plan = bwd.backward_plan(D, q.dtype, 90, causal)
        ref = bwd.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale)
        print(f"{dtype_name} D{D} causal{int(causal)} B{B} Hq{H} Hkv{k.shape[1]} N{N}: default plan {plan}", flush=True)
        fused_ok = []
        for ws in (c for c in ws_candidates(D, q.element_size()) if bwd.fused_dq_fits(c)):
            unfused = [(False, ("plain", (False, False, False)))]
            unfused += [(False, (n, (False, False, True))) for n, sw in variants if sw[2] and n != "default"]
            for fused, (variant, switches) in unfused + [(True, v) for v in variants]:
                status, ms, diffs = "ok", None, None
                for name, on in zip(SWITCHES, switches):
                    setattr(hopper_bwd, name, on)
                bwd._KEPT.clear()  # (a layout planned with other switches)
                name = f"{ws}{'+fused' if fused else ''}" + (f"+{variant}" if variant not in ("default", "plain")
                                                             else "")
                try:
                    if fused or switches[2]:
                        grads = bwd.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale, ws_config=ws,
                                                       ws_dq_config=bwd.FUSED_DQ if fused else None)
                        torch.cuda.synchronize()
                        diffs = relative_difference(grads, ref)
                        if not max(diffs) < 0.02:
                            status = "wrong: max relative difference " + ", ".join(f"{d:.2e}" for d in diffs)
                    if status == "ok":
                        launch = dkdv_launch(tensors, causal, ws, fused)
                        launch.run()
                        ms = bench(launch.run)
                        if fused and switches == default:
                            fused_ok.append(ws)
                except Exception as e:  # noqa: BLE001 - a config that fails is recorded, the rest go on
                    status = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
                rows.append({**cell, "kind": "dkdv", "config": name,
                             "ms": round(ms, 4) if ms else "", "tflops": "",
                             "max_rel_diff": " ".join(f"{d:.2e}" for d in diffs) if diffs else "", "status": status})
                print(f"  dK/dV {name}: "
                      + (f"{ms:.3f} ms" if ms else "") + ("" if status == "ok" else f" {status}")
                      + (f" (dq/dk/dv diff {' '.join(f'{d:.1e}' for d in diffs)})" if diffs else ""), flush=True)
        for name, on in zip(SWITCHES, default):
            setattr(hopper_bwd, name, on)
        bwd._KEPT.clear()
        fns = {"c_default": lambda: bwd.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale)}
        for ws in fused_ok:
            fns[f"c_fused:{ws}"] = (lambda ws=ws: bwd.attention_backward(do, q, k, v, o, lse, causal=causal,
                                                                         scale=scale, ws_config=ws,
                                                                         ws_dq_config=bwd.FUSED_DQ))
        from torch.nn.attention import SDPBackend, sdpa_kernel

        group = H // k.shape[1]
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            qq = q.detach().clone().requires_grad_(True)
            kk, vv = (t.detach().repeat_interleave(group, dim=1).requires_grad_(True) if name == "flash"
                      else t.detach().clone().requires_grad_(True) for t in (k, v))
            try:
                with sdpa_kernel([backend]):
                    oo = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal,
                                                                          enable_gqa=group > 1 and name != "flash")
                fns[name] = (lambda oo=oo, qq=qq, kk=kk, vv=vv:
                             torch.autograd.grad(oo, (qq, kk, vv), do, retain_graph=True))
            except RuntimeError as e:  # a backend that refuses the cell is recorded, the rest go on
                rows.append({**cell, "kind": "whole", "config": name, "ms": "", "tflops": "", "max_rel_diff": "",
                             "status": f"error: {str(e).splitlines()[0][:120]}"})
        samples = {n: [] for n in fns}
        for _ in range(ROUNDS):
            for n, fn in list(fns.items()):
                try:
                    samples[n].append(bench(fn))
                except RuntimeError as e:  # (a backend's backward that refuses the cell)
                    rows.append({**cell, "kind": "whole", "config": n, "ms": "", "tflops": "", "max_rel_diff": "",
                                 "status": f"error: {str(e).splitlines()[0][:120]}"})
                    del fns[n], samples[n]
        for n, t in samples.items():
            ms = statistics.median(t)
            rows.append({**cell, "kind": "whole", "config": n if n != "c_default" else f"c_default:{plan}",
                         "ms": round(ms, 4), "tflops": round(flops / ms * 1e-9, 1), "max_rel_diff": "",
                         "status": "ok"})
        print("  whole: " + ", ".join(f"{n} {statistics.median(t):.3f} ms" for n, t in samples.items()), flush=True)
        _write_csv(args.csv, rows)  # after every cell: a crash keeps what was measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
