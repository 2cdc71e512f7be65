"""The split-KV decode kernel's tiles and pipeline depth against its split count, on a GPU.

A decode step reads the whole K/V cache once: a bandwidth problem whose speed depends on how many
bytes each SM has in flight (the pipeline's depth times the tile), on how long each program runs
before its start-up and drain stop mattering, and on the merge of the splits. The split kernel's
tiles come from one function, ``decode.split_tiles``; this script replaces it by each candidate
(BLOCK_N keys per tile, warps, pipeline stages) and times stage C's whole decode call (split kernel
and merge) at several split counts, on the GPU alone (CUDA-graph replay, L2 flushed between
replays), beside cuDNN. Every candidate's output is checked against stage C's default before it is
timed (max |difference|).

Cells: grouped-query and multi-head decoding, batch 1 to 64, caches of 4k to 128k keys, D 64 and
128, bf16. One CSV row per (cell, tiles, splits); GB/s counts K and V read once and Q and O.

    python experiments/decode_tiles.py --out results/h200/experiments/<date>_decode_tiles.csv
    python experiments/decode_tiles.py --cells b1-gqa-32k --out /tmp/t.csv

``--early-merge`` times something else: stage C's default decode call with the merge launched the
ordinary way, launched early (``decode.EARLY_MERGE``, programmatic dependent launch) and fused into
the split kernel (``LAB_DECODE_MERGE=fused``), in three rounds of turns, beside cuDNN, on every cell
(no tile sweep), each in CUDA-graph replay and launched eagerly (``<label> eager`` rows):

    python experiments/decode_tiles.py --early-merge --out results/h200/experiments/<date>_decode_early_merge.csv

``--plans`` times stage C's default decode call under each decoding plan (``LAB_DECODE_PLAN``:
"waves", two-stage tiles at about four programs per SM; "deep", three-stage tiles as wide as the
shared memory holds at one program per SM), in three rounds of turns, graph replay and eager, beside
cuDNN:

    python experiments/decode_tiles.py --plans --out results/h200/experiments/<date>_decode_plans.csv

``--one-chunk`` asks whether a grid that already has a program per SM needs splitting at all: the
split kernel with a single chunk per KV head (no partials, no merge: one kernel, as cuDNN runs it)
and with two, at deeper pipelines and wider tiles than the default (one program per SM leaves it
the whole shared memory), beside the default call and cuDNN, timed before and after the candidates:

    python experiments/decode_tiles.py --one-chunk --cells decode-gqa,decode-long,mistral-decode,b64-gqa-4k \
        --out results/h200/experiments/<date>_decode_one_chunk.csv
"""

from __future__ import annotations

import argparse
import csv
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stages  # noqa: E402,F401  (before triton)
import torch  # noqa: E402

from harness import timing  # noqa: E402
from harness.peers import peer_attention  # noqa: E402
from stages.c_optimized import decode  # noqa: E402
from stages.c_optimized import kernels as ck  # noqa: E402
from stages.c_optimized.configs import num_sms  # noqa: E402

#: (name, B, Hq, Hkv, Nk, D): Nq = 1, non-causal, bf16
CELLS = [
    ("b1-gqa-4k", 1, 32, 8, 4096, 128),
    ("b1-gqa-32k", 1, 32, 8, 32768, 128),
    ("b1-gqa-128k", 1, 32, 8, 131072, 128),
    ("b1-mha-32k", 1, 32, 32, 32768, 128),
    ("b1-gqa-32k-d64", 1, 32, 8, 32768, 64),
    ("decode-gqa", 16, 32, 8, 8192, 128),
    ("mistral-decode", 8, 32, 8, 16384, 128),
    ("decode-long", 4, 32, 32, 32768, 128),
    ("b64-gqa-4k", 64, 32, 8, 4096, 128),
]

BLOCK_N = (32, 64, 128)
WARPS = (4, 8)
STAGES = (2, 3, 4, 5)
#: programs per SM the split count aims at (the default takes decode.DECODE_WAVES)
WAVES = (1, 2, 4, 8)
#: shared memory one program may take (the H200's 227 KB per block, with room for the compiler's own)
SMEM_BYTES = 220 * 1024


def graph_ms(fn) -> float:
    return timing.summarize(timing.samples_graph(lambda: fn, 50, 100), True).ms_median


def eager_ms(fn) -> float:
    """Launched from Python call by call (CUDA events around each, the L2 flushed before it), as a
    model without CUDA graphs runs it: each launch's gap is in the time."""
    return timing.summarize(timing.samples_gpu(fn, 50, 100), True).ms_median


def use_tiles(tiles: decode.SplitTiles | None, early_merge: bool | None = None, splits: int | None = None,
              merge: str | None = None, plan: str | None = None) -> None:
    """Make every plan from here on take ``tiles`` (None: the default), launch the merge early or
    not (None: the module's choice) and split a decoding call's keys into ``splits`` chunks (None:
    as ``decode.decode_splits`` counts them; 1 is reachable only this way, ``split_kv=1`` means the
    one-pass kernel), merge the splits as ``merge`` says (``decode.MERGES``; None: the module's
    choice) and plan decoding calls as ``plan`` says (``decode.DECODE_PLANS``), forgetting what was
    cached."""
    decode.split_tiles = (lambda group, Nq, D, element_bytes=2: tiles) if tiles is not None else DEFAULT_TILES
    # (the deep plan would replace the tiles; None: the module's plan)
    decode.DECODE_PLAN = "waves" if tiles is not None else plan or DEFAULT_PLAN
    decode.EARLY_MERGE = DEFAULT_EARLY_MERGE if early_merge is None else early_merge
    decode.decode_splits = (lambda *args: splits) if splits is not None else DEFAULT_DECODE_SPLITS
    decode.MERGE = DEFAULT_MERGE if merge is None else merge
    ck._select.cache_clear()
    ck._recipe.cache_clear()
    ck._LAYOUT_PLANS.clear()
    decode._wanted_splits.cache_clear()


DEFAULT_TILES = decode.split_tiles
DEFAULT_EARLY_MERGE = decode.EARLY_MERGE
DEFAULT_DECODE_SPLITS = decode.decode_splits
DEFAULT_MERGE = decode.MERGE
DEFAULT_PLAN = decode.DECODE_PLAN
#: ``--early-merge``'s contestants: label -> ``use_tiles`` settings (merge launched early, how the splits merge)
MERGE_VARIANTS = {"merge-after": dict(early_merge=False, merge="wide"),
                  "merge-early": dict(early_merge=True, merge="wide"),
                  "merge-fused": dict(early_merge=False, merge="fused")}
#: ``--plans``' contestants: each decoding plan
PLAN_VARIANTS = {f"plan-{plan}": dict(plan=plan) for plan in decode.DECODE_PLANS}
#: ``--one-chunk``'s tiles: (keys per tile, warps, pipeline stages), within one program's share of an
#: SM when it is alone there
ONE_CHUNK_TILES = [(64, w, s) for w in (4, 8) for s in (2, 3, 4, 5)] + [(128, w, s) for w in (4, 8) for s in (2, 3)]
#: rounds of turns in ``--early-merge`` mode
ROUNDS = 3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cells", default="", help="comma-separated cell names (default: all)")
    ap.add_argument("--early-merge", action="store_true",
                    help="time the merge launched after, early and fused, in turns (no tile sweep)")
    ap.add_argument("--plans", action="store_true",
                    help="time each decoding plan (decode.DECODE_PLANS) in turns, graph replay and eager")
    ap.add_argument("--one-chunk", action="store_true",
                    help="time one and two chunks per KV head at deeper pipelines against the default")
    args = ap.parse_args(argv)
    cells = [c for c in CELLS if not args.cells or c[0] in args.cells.split(",")]
    sms = num_sms(torch.device("cuda"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["cell", "B", "Hq", "Hkv", "Nk", "D", "candidate", "block_m", "block_n", "num_warps",
                    "num_stages", "splits", "ms_gpu", "gbps", "max_abs_diff", "status"])
        for name, B, Hq, Hkv, Nk, D in cells:
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(B, Hq, 1, D, device="cuda", generator=g).bfloat16()
            k = torch.randn(B, Hkv, Nk, D, device="cuda", generator=g).bfloat16()
            v = torch.randn(B, Hkv, Nk, D, device="cuda", generator=g).bfloat16()
            nbytes = 2 * (2 * k.numel() + 2 * q.numel())
            group = Hq // Hkv
            use_tiles(None)
            ref = ck.attention(q, k, v)
            default = DEFAULT_TILES(group, 1, D)
            items = B * Hkv * -(-group // default.block_m)

            def row(label, tiles, splits, fn, eager=False):
                try:
                    out = fn()
                    torch.cuda.synchronize()
                    diff = (out.float() - ref.float()).abs().max().item() if label != "cudnn" else ""
                    ms = eager_ms(fn) if eager else graph_ms(fn)
                    w.writerow([name, B, Hq, Hkv, Nk, D, label, *(tiles or ("",) * 4), splits, f"{ms:.5f}",
                                f"{nbytes / ms / 1e6:.0f}", diff, "ok"])
                    print(f"{name} {label} {tiles} splits={splits}: {ms * 1e3:.1f} us "
                          f"{nbytes / ms / 1e6:.0f} GB/s", flush=True)
                except Exception as e:  # out of shared memory, a compile error: recorded, the sweep goes on
                    w.writerow([name, B, Hq, Hkv, Nk, D, label, *(tiles or ("",) * 4), splits, "", "", "",
                                f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"])
                f.flush()

            use_tiles(None)
            tiles_default = (default.block_m, default.block_n, default.num_warps, default.num_stages)
            cudnn = peer_attention("sdpa_cudnn")
            contestants = PLAN_VARIANTS if args.plans else MERGE_VARIANTS if args.early_merge else None
            if contestants:  # rounds of turns, each way in graph replay and eagerly, then cuDNN
                for _ in range(ROUNDS):
                    for label, settings in contestants.items():
                        use_tiles(None, **settings)
                        t = ck._plan_call(q, k, v, ref, None, False, ck._arch_and_sms(q)[0], sms)[0].config
                        label_tiles = (t.block_m, t.block_n, t.num_warps, t.num_stages)
                        row(label, label_tiles, "", lambda: ck.attention(q, k, v))
                        row(label + " eager", label_tiles, "", lambda: ck.attention(q, k, v), eager=True)
                    row("cudnn", None, "", lambda: cudnn(q, k, v, causal=False))
                    row("cudnn eager", None, "", lambda: cudnn(q, k, v, causal=False), eager=True)
                use_tiles(None)
                del q, k, v, ref
                torch.cuda.empty_cache()
                continue
            row("default", tiles_default, "", lambda: ck.attention(q, k, v))
            row("cudnn", None, "", lambda: cudnn(q, k, v, causal=False))
            if args.one_chunk:
                for (block_n, warps, stages_), splits in itertools.product(ONE_CHUNK_TILES, (1, 2)):
                    if stages_ * block_n * D * 2 * 2 > SMEM_BYTES:
                        continue
                    tiles = decode.SplitTiles(default.block_m, block_n, warps, stages_)
                    use_tiles(tiles, splits=splits)
                    row(f"chunks-{splits}", (tiles.block_m, block_n, warps, stages_), splits,
                        lambda: ck.attention(q, k, v))
                use_tiles(None)
                row("default", tiles_default, "", lambda: ck.attention(q, k, v))
                row("cudnn", None, "", lambda: cudnn(q, k, v, causal=False))
                del q, k, v, ref
                torch.cuda.empty_cache()
                continue
            for block_n, warps, stages_ in itertools.product(BLOCK_N, WARPS, STAGES):
                if stages_ * block_n * D * 2 * 2 > SMEM_BYTES:
                    continue
                tiles = decode.SplitTiles(default.block_m, block_n, warps, stages_)
                use_tiles(tiles)
                seen = set()
                for waves in WAVES:
                    splits = max(1, min(round(waves * sms / items), -(-Nk // block_n), decode.MAX_SPLITS))
                    splits = decode.split_counts(block_n, Nk, splits)[0]
                    if splits in seen or splits < 2:
                        continue
                    seen.add(splits)
                    row("sweep", (tiles.block_m, block_n, warps, stages_), splits,
                        lambda s=splits: ck.attention(q, k, v, split_kv=s))
            use_tiles(None)
            del q, k, v, ref
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
