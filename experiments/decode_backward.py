"""The split-KV backward against the ordinary one on decoding-shaped problems, and its tiles and split count.

A decoding-shaped backward (the group's query rows fit one tile, Nq < Nk) runs ``decode_backward.py``:
each program holds every query row and walks a chunk of the keys, writing dK and dV tile by tile. The
ordinary plan (the tuned Hopper or ``tl`` kernels, ``LAB_BWD_SPLIT_KV=0``) gives each program one K/V
tile and a one-tile walk over the queries. For each cell this times, on the GPU alone
(``triton.testing.do_bench``, whole backward: every kernel of it):

* ``split`` (the default) and ``ordinary``, in ``--rounds`` interleaved rounds beside cuDNN's and
  FlashAttention-2's backward through SDPA (autograd, the same dO);
* one round of each tile candidate (``block_n`` keys, warps, pipeline stages) at the default split
  count, and of each split count (``BACKWARD_WAVES`` programs per SM) at the default tiles.

Every candidate's gradients are checked against the ordinary plan's first (max relative difference).
GB/s counts the least a backward moves: K and V read, dK and dV written.

    python experiments/decode_backward.py --csv results/h200/experiments/<date>_decode_backward.csv
    python experiments/decode_backward.py --cells decode-long --no-sweep
"""

from __future__ import annotations

import argparse
import csv
import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import stages  # noqa: E402,F401  (before triton)
import torch  # noqa: E402

#: name -> (B, Hq, Hkv, Nq, Nk, D, dtype, causal)
CELLS = {
    "decode-long": (4, 32, 32, 1, 32768, 128, "fp16", False),
    "decode-gqa": (16, 32, 8, 1, 8192, 128, "bf16", False),
    "b1-gqa-32k": (1, 32, 8, 1, 32768, 128, "bf16", False),
    "spec-16": (4, 32, 8, 16, 4096, 128, "bf16", True),
    "mha-d64": (8, 16, 16, 1, 16384, 64, "bf16", False),
    "b1-d256": (1, 16, 16, 1, 8192, 256, "bf16", False),
}
BLOCK_N = (32, 64, 128)
WARPS = (4, 8)
STAGES = (2, 3)
WAVES = (1, 2, 4, 8)
FIELDS = ["cell", "B", "Hq", "Hkv", "Nq", "Nk", "D", "dtype", "causal", "candidate", "block_n", "num_warps",
          "num_stages", "waves", "splits", "round", "ms", "gbps", "max_rel_diff", "status"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default=",".join(CELLS), help=f"some of {','.join(CELLS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-sweep", action="store_true", help="time split, ordinary and the peers only")
    ap.add_argument("--csv", required=True)
    args = ap.parse_args(argv)
    names = args.cells.split(",")
    unknown = [c for c in names if c not in CELLS]
    if unknown:
        ap.error(f"--cells: unknown {', '.join(unknown)}; choose from {', '.join(CELLS)}")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if not torch.cuda.is_available():
        print("decode_backward.py times GPU kernels: it needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from stages.c_optimized import backward as bwd
    from stages.c_optimized import decode_backward as dbwd
    from stages.c_optimized.kernels import attention_with_lse

    default_tiles, default_waves = dbwd.split_backward_tiles, dbwd.BACKWARD_WAVES
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    out = open(args.csv, "w", newline="")
    writer = csv.DictWriter(out, FIELDS)
    writer.writeheader()

    def use(enabled=True, tiles=None, waves=None):
        dbwd.ENABLED = enabled
        dbwd.split_backward_tiles = (lambda group, Nq, D, element_bytes=2: tiles) if tiles is not None else default_tiles
        dbwd.BACKWARD_WAVES = default_waves if waves is None else waves
        bwd._KEPT.clear()

    for name in names:
        B, Hq, Hkv, Nq, Nk, D, dtype_name, causal = CELLS[name]
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, Hq, Nq, D, device="cuda", dtype=dtype, generator=gen)
        k, v = (torch.randn(B, Hkv, Nk, D, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
        o, lse = attention_with_lse(q, k, v, causal=causal)
        do = torch.randn_like(o)
        scale = D ** -0.5
        nbytes = 4 * k.numel() * k.element_size()
        base = dict(cell=name, B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, dtype=dtype_name, causal=int(causal))

        def backward():
            return bwd.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale)

        use(enabled=False)
        ref = backward()
        torch.cuda.synchronize()

        def row(candidate, rnd, fn, check=True, **fields):
            r = dict(base, candidate=candidate, round=rnd, **fields)
            try:
                if check:
                    grads = fn()
                    torch.cuda.synchronize()
                    r["max_rel_diff"] = f"{max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)) for a, b in zip(grads, ref)):.2e}"
                ms = triton.testing.do_bench(fn, warmup=10, rep=40)
                r.update(ms=f"{ms:.5f}", gbps=f"{nbytes / ms / 1e6:.0f}", status="ok")
            except Exception as e:  # noqa: BLE001 - a candidate that fails is recorded, the others go on
                r["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            writer.writerow(r)
            out.flush()
            print(f"{name} {candidate} {fields or ''} round {rnd}: {r.get('ms', r['status'])} ms", flush=True)

        peers = {}
        for label, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
            try:
                with sdpa_kernel([backend]):
                    oo = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal,
                                                                          enable_gqa=Hq != Hkv)
                peers[label] = (lambda oo=oo, leaves=(qq, kk, vv): torch.autograd.grad(oo, leaves, do,
                                                                                      retain_graph=True))
            except Exception as e:  # noqa: BLE001
                writer.writerow(dict(base, candidate=label, status=f"error: {type(e).__name__}: "
                                                                   f"{str(e).splitlines()[0][:120]}"))
        splits = {}
        for rnd in range(args.rounds):
            use(enabled=True)
            splits["split"] = bwd.split_backward(q, k)[0]
            row("split", rnd, backward, check=rnd == 0, waves=default_waves, splits=splits["split"])
            use(enabled=False)
            row("ordinary", rnd, backward, check=False)
            for label, fn in peers.items():
                row(label, rnd, fn, check=False)
        if not args.no_sweep:
            t0 = default_tiles(Hq // Hkv, Nq, D, q.element_size())
            for block_n, warps, stages_ in itertools.product(BLOCK_N, WARPS, STAGES):
                tiles = dbwd.SplitBwdTiles(t0.block_m, block_n, warps, stages_)
                use(tiles=tiles)
                taken = bwd.split_backward(q, k)
                if taken is None:  # its shared memory would not fit (the path's own gate): no kernel to time
                    writer.writerow(dict(base, candidate="tiles", block_n=block_n, num_warps=warps,
                                         num_stages=stages_, status="skipped: over the shared memory"))
                    continue
                row("tiles", 0, backward, block_n=block_n, num_warps=warps, num_stages=stages_,
                    waves=default_waves, splits=taken[0])
            for waves in WAVES:
                use(waves=waves)
                row("waves", 0, backward, block_n=t0.block_n, num_warps=t0.num_warps, num_stages=t0.num_stages,
                    waves=waves, splits=bwd.split_backward(q, k)[0])
        use()
        del q, k, v, o, lse, do, ref, peers
        torch.cuda.empty_cache()
    out.close()
    rows = list(csv.DictReader(open(args.csv)))
    for name in names:
        med = {c: statistics.median(float(r["ms"]) for r in rows if r["cell"] == name and r["candidate"] == c
                                    and r["status"] == "ok")
               for c in ("split", "ordinary", "cudnn", "flash")
               if any(r["cell"] == name and r["candidate"] == c and r["status"] == "ok" for r in rows)}
        print(name, "  ".join(f"{c} {ms:.4f} ms" for c, ms in med.items()),
              f"  split/cudnn {med['cudnn'] / med['split']:.2f}x" if "cudnn" in med and "split" in med else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
