"""In what order a causal backward's programs should start: head by head, or heaviest tiles first.

A causal dK/dV program's work depends on its K/V tile: the first tile meets every Q tile of its
batch·head, the last only the diagonal's. The GPU starts programs in grid order as SMs free up, so
with one batch·head's tiles after another (heaviest first within each) the last wave starts the
heavy tiles of the last heads while the SMs that finished early sit idle. ``hopper_bwd.HEAVY_FIRST``
(``LAB_BWD_HEAVY_FIRST``) takes the tiles in chunks across every batch·head instead, heaviest chunk
first; a smaller chunk balances better and keeps fewer programs of one head side by side (which
share its Q and dO tiles in L2).

An order ``CgG`` (``1g4``, ``8g2``) takes chunks of ``C`` tiles within groups of ``G`` batch·heads, one
group after another (``hopper_bwd.HEAD_GROUP``, ``LAB_BWD_HEAD_GROUP``): heavy tiles still first within a
group, and the programs side by side read fewer batch·heads' Q and dO.

For each cell this prints and writes, per order (0 = head by head; ``auto``: the default):

* ``model``: the list-scheduling model's end time over the balanced one (``hopper_bwd.makespan``:
  one program per SM, each program's work its Q tiles times the group's query heads), and ``in_flight``:
  the most batch·heads among any SM-count of programs next to each other (``hopper_bwd.heads_in_flight``);
* ``ms``: stage C's whole backward (its default plan with that order), in interleaved rounds beside
  cuDNN's backward, and each order's gradients against the head-by-head ones first.

    python experiments/program_order.py --csv results/h200/experiments/<date>_program_order.csv
    python experiments/program_order.py --model-only            # the model's column alone, no GPU
    python experiments/program_order.py --cells llama3-8b,odd-n --chunks 0,4,2,1
    python experiments/program_order.py --chunks auto,1g2,1g4,2g4
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


#: name -> (B, Hq, Hkv, N, D, dtype): causal training shapes (the model suite's, and the FA grid's).
CELLS = {
    "llama3-8b": (1, 32, 8, 8192, 128, "bf16"),
    "llama2-7b": (4, 32, 32, 2048, 128, "bf16"),
    "gpt2": (32, 12, 12, 1024, 64, "bf16"),
    "odd-n": (3, 20, 20, 1500, 64, "fp16"),
    "grid-d64-n1024": (16, 32, 32, 1024, 64, "bf16"),
    "grid-d64-n4096": (4, 32, 32, 4096, 64, "bf16"),
    "grid-d128-n1024": (16, 16, 16, 1024, 128, "bf16"),
    "grid-d128-n4096": (4, 16, 16, 4096, 128, "bf16"),
    "grid-d128-n16384": (1, 16, 16, 16384, 128, "bf16"),
}
ROUNDS = 5
SMS = 132  # (the H200's; a GPU's own count where one is present)


def model_ratio(cell, chunk: int | str, block_m: int = 64, kv_rows: int = 128, sms: int = SMS,
                group: int | str = "auto") -> tuple[str, float, int]:
    """The order the kernels take for this setting (``hopper_bwd.causal_order``: ``CgG``, or ``C`` across
    every batch·head; 0: head by head), the modelled end of the causal dK/dV kernel's programs in that
    order over the balanced end, and the batch·heads in flight."""
    from stages.c_optimized import hopper_bwd

    B, Hq, Hkv, N, _, _ = cell
    work = hopper_bwd.causal_dkdv_work(N, N, kv_rows, block_m, Hq // Hkv)
    taken = hopper_bwd.causal_order(work, B * Hkv, sms, chunk, group)
    c, g = taken["tiles_per_chunk"], taken["heads_per_group"]
    order = hopper_bwd.program_order(len(work), B * Hkv, c, g)
    total = sum(work[t] for t, _ in order)
    label = "0" if c >= len(work) else (f"{c}g{g}" if g < B * Hkv else str(c))
    return label, hopper_bwd.makespan([work[t] for t, _ in order], sms) / (total / sms), hopper_bwd.heads_in_flight(
        order, sms)


def _order(text: str) -> tuple[int | str, int | str]:
    """(chunk, group) of an order: ``auto`` (the default: both chosen by the model), ``C`` (chunks of C
    across every batch·head; ``auto`` chunks so: ``autog0``) or ``CgG``."""
    if text == "auto":
        return "auto", "auto"
    chunk, _, group = text.partition("g")
    if group and not group.isdigit():
        raise ValueError(text)
    return (chunk if chunk == "auto" else int(chunk)), int(group or 0)


def _label(order: tuple) -> str:
    chunk, group = order
    if group == "auto":
        return "auto"
    return f"{chunk}g{group}" if group else ("autog0" if chunk == "auto" else str(chunk))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default=",".join(CELLS), help=f"some of {','.join(CELLS)}")
    ap.add_argument("--chunks", default="0,8,4,2,1,autog0,auto",
                    help="orders: hopper_bwd.HEAVY_FIRST values across every batch·head (0: head by head; autog0: "
                         "the chunk chosen by the model), or in groups of G batch·heads (CgG, e.g. 1g4); auto: the "
                         "default, chunk and group chosen by the model")
    ap.add_argument("--model-only", action="store_true", help="print the model's column alone (no GPU needed)")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)
    unknown = [c for c in args.cells.split(",") if c not in CELLS]
    if unknown:
        ap.error(f"--cells: unknown {', '.join(unknown)}; choose from {', '.join(CELLS)}")
    try:
        chunks = [_order(c) for c in args.chunks.split(",")]
    except ValueError:
        ap.error(f"--chunks: auto or whole numbers >= 0, each optionally with g and a group >= 1 (1g4), "
                 f"comma-separated; got {args.chunks!r}")
    if any(c != "auto" and c < 0 for c, _ in chunks):
        ap.error(f"--chunks: auto or whole numbers >= 0, got {args.chunks!r}")
    names = args.cells.split(",")
    if args.model_only:
        for name in names:
            print(f"{name:18s} " + "  ".join(
                "{}: {:.3f} ({} in flight)".format(_label(o) if o[0] != "auto" else f"{_label(o)} ({taken})", ratio,
                                                   flight)
                for o in chunks for taken, ratio, flight in [model_ratio(CELLS[name], o[0], group=o[1])]))
        return 0
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("program_order.py times the Hopper backward kernels: it needs an sm_90 GPU (--model-only runs "
              "anywhere)", file=sys.stderr)
        return 2
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from stages.c_optimized import backward as bwd
    from stages.c_optimized import hopper_bwd
    from stages.c_optimized.kernels import attention_with_lse
    from stages.c_optimized.tune_backward import _write_csv

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default_chunk, default_group = hopper_bwd.HEAVY_FIRST, hopper_bwd.HEAD_GROUP
    rows: list[dict] = []
    for name in names:
        B, Hq, Hkv, N, D, dtype_name = cell = CELLS[name]
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype, generator=gen)
        k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
        o, lse = attention_with_lse(q, k, v, causal=True)
        do = torch.randn_like(o)
        scale = D ** -0.5
        plan = bwd.backward_plan(D, dtype, 90, True)
        block_m = plan.ws.block_m if plan.ws is not None else 64

        def backward():
            return bwd.attention_backward(do, q, k, v, o, lse, causal=True, scale=scale)

        fns, status = {}, {}
        ref = None
        for chunk in chunks:
            hopper_bwd.HEAVY_FIRST, hopper_bwd.HEAD_GROUP = chunk
            bwd._KEPT.clear()  # (a layout planned with another order)
            try:
                grads = backward()
                torch.cuda.synchronize()
                if ref is None:
                    ref = grads
                diff = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                           for a, b in zip(grads, ref))
                status[chunk] = "ok" if diff < 0.02 else f"wrong: max relative difference {diff:.2e}"
                if status[chunk] == "ok":
                    fns[chunk] = backward
            except Exception as e:  # noqa: BLE001 - an order that fails is recorded, the others go on
                status[chunk] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            oo = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=Hq != Hkv)
        cudnn = lambda: torch.autograd.grad(oo, (qq, kk, vv), do, retain_graph=True)  # noqa: E731
        samples = {key: [] for key in [*fns, "cudnn"]}
        for _ in range(ROUNDS):
            for chunk in fns:
                hopper_bwd.HEAVY_FIRST, hopper_bwd.HEAD_GROUP = chunk
                bwd._KEPT.clear()
                samples[chunk].append(triton.testing.do_bench(backward, warmup=10, rep=60))
            samples["cudnn"].append(triton.testing.do_bench(cudnn, warmup=10, rep=60))
        hopper_bwd.HEAVY_FIRST, hopper_bwd.HEAD_GROUP = default_chunk, default_group
        bwd._KEPT.clear()
        cudnn_ms = statistics.median(samples["cudnn"])
        for chunk in chunks:
            ms = statistics.median(samples[chunk]) if chunk in fns else None
            taken, ratio, flight = model_ratio(cell, chunk[0], block_m, sms=sms, group=chunk[1])
            rows.append(dict(cell=name, B=B, Hq=Hq, Hkv=Hkv, N=N, D=D, dtype=dtype_name, causal=1, plan=str(plan),
                             chunk=_label(chunk), taken=taken, model=round(ratio, 4), in_flight=flight,
                             ms=round(ms, 4) if ms else "", cudnn_ms=round(cudnn_ms, 4),
                             c_over_cudnn=round(cudnn_ms / ms, 3) if ms else "", status=status[chunk]))
        print(f"{name}: cuDNN {cudnn_ms:.3f} ms; " + ", ".join(
            f"chunk {r['chunk']}: {r['ms'] or r['status']} ms (model {r['model']:.3f})"
            for r in rows if r["cell"] == name), flush=True)
        _write_csv(args.csv, rows)  # after every cell: a crash keeps what was measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
