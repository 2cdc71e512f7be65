"""The Hopper dK/dV kernel on a persistent grid (``hopper_bwd.PERSISTENT_DKDV``) against one program per item.

One program per work item (a K/V tile of one batch·K/V head) ends each item with its pipeline empty: dK
and dV stored through the K/V buffers and the store waited for, then a new program sets up its barriers,
loads its K/V tiles and its first Q/dO tiles. A persistent program (one per SM) walks items: it releases
an item's K/V buffers as soon as its consumers are done reading them, so the producer loads the next
item's while dK and dV leave from the registers, and the ring of Q/dO slots runs on. The fixed cost per
item matters most where items are short (N 1024: 16 Q tiles per K/V tile).

For each cell, stage C's whole backward (its default plan, ``bwd.attention_backward`` given a saved
forward) with the switch off and on, and with ``--deterministic`` the deterministic backward both ways,
timed in interleaved rounds beside cuDNN's backward (SDPA's CUDNN backend, ``torch.autograd.grad`` of a
kept forward); each "on" variant's gradients against its "off" one's first.

    python experiments/bwd_persistent.py --csv results/<gpu>/experiments/<date>_bwd_persistent.csv
    python experiments/bwd_persistent.py --cells grid-d64-n1024,gpt2 --deterministic
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

#: name -> (B, Hq, Hkv, N, D, dtype, causal): the FA grid's backward cells (B·N = 16384, H·D = 2048) and
#: model-shaped ones (GPT-2 small, Llama 3 8B's grouped heads, an odd size, a head-dim tail).
CELLS = {
    **{f"grid-d{D}-n{N}{'-causal' if c else ''}": (16384 // N, 2048 // D, 2048 // D, N, D, "bf16", c)
       for D in (64, 128) for N in (1024, 4096, 16384) for c in (False, True)},
    "gpt2": (32, 12, 12, 1024, 64, "bf16", True),
    "llama3-8b": (1, 32, 8, 8192, 128, "bf16", True),
    "odd-n": (3, 20, 20, 1500, 64, "fp16", False),
    "d80": (4, 25, 25, 4096, 80, "bf16", False),
}
ROUNDS = 5


def parse_cell_arguments(doc: str, argv, script: str, extra=None, cells: dict | None = None, rounds: int = ROUNDS):
    """The arguments of a script over these cells (``cells``, this module's :data:`CELLS` where None):
    ``--cells``, ``--rounds`` (default ``rounds``), ``--csv`` and what ``extra(ap)`` adds, parsed and checked
    (:func:`check_arguments`); None where there is no sm_90 GPU (it said why)."""
    cells = CELLS if cells is None else cells
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--cells", default=",".join(cells), help=f"some of {','.join(cells)}")
    ap.add_argument("--rounds", type=int, default=rounds, help=f"interleaved rounds (default {rounds})")
    ap.add_argument("--csv", default=None)
    if extra is not None:
        extra(ap)
    args = ap.parse_args(argv)
    return args if check_arguments(ap, args, script, cells) else None


def check_arguments(ap, args, script: str, cells: dict | None = None) -> bool:
    """``--cells`` (of ``cells``, :data:`CELLS` where None) and ``--rounds`` checked (an argparse error names the
    allowed values); False, with a line saying why, where there is no sm_90 GPU to time the Hopper kernels on."""
    cells = CELLS if cells is None else cells
    unknown = [c for c in args.cells.split(",") if c not in cells]
    if unknown:
        ap.error(f"--cells: unknown {', '.join(unknown)}; choose from {', '.join(cells)}")
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print(f"{script} times the Hopper backward kernels: it needs an sm_90 GPU", file=sys.stderr)
        return False
    return True


def medians_in_turns(fns: dict, rounds: int) -> dict:
    """{name: median ms} of each callable in ``fns``, timed in ``rounds`` interleaved rounds (each round times
    every one in turn: do_bench, 10 ms of warm-up, 60 ms of repetitions), so a drift of the GPU's pace
    falls on all of them alike."""
    import triton.testing

    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(triton.testing.do_bench(fn, warmup=10, rep=60))
    return {name: statistics.median(t) for name, t in samples.items()}


def cell_inputs(cell: tuple):
    """A cell's inputs on the GPU, its saved forward (stage C's) and cuDNN's backward of the same problem:
    (q, k, v, o, lse, do, scale, cudnn), ``cudnn()`` SDPA's CUDNN backend's ``torch.autograd.grad`` of a
    kept forward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from stages.c_optimized.kernels import attention_with_lse

    B, Hq, Hkv, N, D, dtype_name, causal = cell
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    o, lse = attention_with_lse(q, k, v, causal=causal)
    do = torch.randn_like(o)
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        oo = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, enable_gqa=Hq != Hkv)
    return q, k, v, o, lse, do, D ** -0.5, lambda: torch.autograd.grad(oo, (qq, kk, vv), do, retain_graph=True)


def main(argv=None) -> int:
    args = parse_cell_arguments(__doc__, argv, "bwd_persistent.py", lambda ap: ap.add_argument(
        "--deterministic", action="store_true",
        help="also the deterministic backward (dQ by a kernel of its own), off and on"))
    if args is None:
        return 2
    import triton.testing

    from stages.c_optimized import backward as bwd
    from stages.c_optimized import hopper_bwd
    from stages.c_optimized.tune_backward import _write_csv

    default = hopper_bwd.PERSISTENT_DKDV
    modes = [False, True] if args.deterministic else [False]
    rows: list[dict] = []
    for name in args.cells.split(","):
        B, Hq, Hkv, N, D, dtype_name, causal = CELLS[name]
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
        q, k, v, o, lse, do, scale, cudnn = cell_inputs(CELLS[name])
        variants = [(det, on) for det in modes for on in (False, True)]

        def backward(det):
            return lambda: bwd.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale, deterministic=det)

        def switch(on):
            hopper_bwd.PERSISTENT_DKDV = on
            bwd._KEPT.clear()  # (a layout planned under the other setting)

        status, ref = {}, {}
        for det, on in variants:
            switch(on)
            try:
                grads = backward(det)()
                torch.cuda.synchronize()
                ref.setdefault(det, grads)
                diff = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                           for a, b in zip(grads, ref[det]))
                status[det, on] = "ok" if diff < 0.02 else f"wrong: max relative difference {diff:.2e}"
            except Exception as e:  # noqa: BLE001 - a variant that fails is recorded, the others go on
                status[det, on] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        timed = [x for x in variants if status[x] == "ok"]
        samples = {x: [] for x in [*timed, "cudnn"]}
        for _ in range(args.rounds):
            for det, on in timed:
                switch(on)
                backward(det)()  # (plans and binds the layout outside the timing)
                samples[det, on].append(triton.testing.do_bench(backward(det), warmup=10, rep=60))
            samples["cudnn"].append(triton.testing.do_bench(cudnn, warmup=10, rep=60))
        switch(default)
        cudnn_ms = statistics.median(samples["cudnn"])
        ms = {x: statistics.median(samples[x]) for x in timed}
        plan = bwd.backward_plan(D, dtype, 90, causal)
        for det, on in variants:
            t = ms.get((det, on))
            off = ms.get((det, False))
            rows.append(dict(cell=name, B=B, Hq=Hq, Hkv=Hkv, N=N, D=D, dtype=dtype_name, causal=int(causal),
                             plan=str(plan), deterministic=int(det), persistent=int(on),
                             ms=round(t, 4) if t else "", cudnn_ms=round(cudnn_ms, 4),
                             c_over_cudnn=round(cudnn_ms / t, 3) if t else "",
                             on_over_off=round(off / t, 3) if t and off else "", status=status[det, on]))
        print(f"{name}: cuDNN {cudnn_ms:.3f} ms; " + ", ".join(
            f"{'det ' if r['deterministic'] else ''}{'persistent' if r['persistent'] else 'per item'} "
            f"{r['ms'] or r['status']} ({r['c_over_cudnn']}x cuDNN)" for r in rows if r["cell"] == name), flush=True)
        _write_csv(args.csv, rows)  # after every cell: a crash keeps what was measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
