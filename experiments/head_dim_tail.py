"""A head dim past a power of two by a little: pad it to the next power of two, or run a narrow tail?

Stage C's warp-specialized forward runs a head dim between the powers of two either in tiles as wide
as the next power of two (``-pad`` configs: D 136 costs 256 columns of multiply-adds) or as a main
part of half that and a tail of its own, the next power of two of what is left and at least 16
columns (``hopper_ws.tile_widths``: D 136 = 128 + 16). For every head dim given: the padded kernel
as it ran before the tail (the padded width's first config, ``-pad``), every config the tail takes
(``configs.ws_shapes``), and cuDNN, timed in turns (``ab.time_in_turns``, ``do_bench`` samples) at
the FlashAttention-paper sizes (B·N = 16384, H = 2048 // D), outputs checked against cuDNN's.

    python experiments/head_dim_tail.py --csv results/h200/experiments/<date>_head_dim_tail.csv
    python experiments/head_dim_tail.py --D 136,192 --dtype fp16 --causal no --csv <file>
    python experiments/head_dim_tail.py --D 136,192 --also WS-M128-N64-s2-P --csv <file>   # more configs
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stages  # noqa: E402,F401  (before triton)
from ab import run_ab  # noqa: E402
from stages.c_optimized import hopper_ws  # noqa: E402
from stages.c_optimized import kernels as ck  # noqa: E402
from stages.c_optimized.configs import WS_SHAPES, Config, fits, ws_shapes  # noqa: E402
from stages.contract import padded_head_dim  # noqa: E402

#: Every head dim that runs with a tail (multiples of 8 from 72 to 192 whose tile_widths has one).
TAIL_DIMS = tuple(D for D in range(72, 193, 8) if hopper_ws.tile_widths(D)[1])


def variants(q, k, v, causal: bool, also: tuple = ()) -> dict:
    """{"padded": the padded kernel, "tail <config>": each tail config, and each of ``also`` that fits}:
    calls of stage C."""
    D = q.shape[-1]
    padded = replace(WS_SHAPES[padded_head_dim(D)][0], pad_head_dim=True)
    out = {"padded": lambda: ck.attention(q, k, v, causal=causal, config=padded)}
    tried = ws_shapes(D) + [c for c in also if c not in ws_shapes(D) and fits(c, D, q.element_size(), 90)]
    for config in tried:
        out[f"tail {config}"] = lambda c=config: ck.attention(q, k, v, causal=causal, config=c)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", required=True, help="rows are appended (run,dtype,D,causal,N,impl,ms,...)")
    ap.add_argument("--D", default=",".join(map(str, TAIL_DIMS)), help="head dims (default: every one with a tail)")
    ap.add_argument("--dtype", default="bf16,fp16")
    ap.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--also", default="", help="more warp-specialized configs to race where they fit, e.g. "
                    "WS-M128-N64-s2-P")
    args = ap.parse_args(argv)
    causals = {"no": (False, ), "yes": (True, ), "both": (False, True)}[args.causal]
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    also = tuple(Config.parse(c) for c in args.also.split(",") if c)
    run_ab(Path(args.csv), lambda q, k, v, causal: variants(q, k, v, causal, also), baseline="padded", dtypes=tuple(args.dtype.split(",")),
           Ds=tuple(int(d) for d in args.D.split(",")), Ns=(args.N, ), causals=causals, turns=args.turns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
