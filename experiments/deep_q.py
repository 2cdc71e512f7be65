"""Three Q buffers per consumer (``-Q3``): does fetching each item's Q two items ahead pay, and where?

The persistent warp-specialized kernel fetches the next item's Q into the buffer the previous
item's O just left through, after the current item's first softmax. For an item of one or two
K/V tiles (short sequences: BERT, ViT, the suite's ``short`` cell) that is almost no time before
the next item's first product needs it; a third buffer lets the fetch start a whole item earlier,
for 8 KB (D 64) or 16 KB (D 128) more shared memory per consumer.

For every cell: the config stage C chooses, its ``-Q3`` twin (where the chosen one is persistent and
the twin fits), and cuDNN, timed in turns on the GPU alone (CUDA-graph replay, L2 flushed), outputs
checked against cuDNN's. Cells: the model suite's square cells and the FA-paper grid (fp16, D 64
and 128, causal both, N 1k-16k), plus a few sequence lengths between them.

    python experiments/deep_q.py --out results/h200/experiments/2026-12-04_deep_q.csv
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stages  # noqa: E402,F401  (before triton)
from ab import cudnn, time_in_turns  # noqa: E402
from harness import timing  # noqa: E402
from harness.inputs import make_inputs  # noqa: E402
from harness.suites import SUITES  # noqa: E402
from stages.c_optimized import kernels as ck  # noqa: E402
from stages.c_optimized.configs import fits, num_sms  # noqa: E402
from stages.contract import DTYPES, Problem  # noqa: E402
from suite_configs import keep_named  # noqa: E402

#: (name, B, Hq, Hkv, N, D, causal, dtype): the FA-paper grid (B·N = 16k, H·D = 2048) and lengths
#: between the suite's (197: ViT-B; 384 and 512: BERT-style batches)
EXTRA = [(f"fa-{N}-d{D}-{'c' if c else 'nc'}", 16384 // N, 2048 // D, 2048 // D, N, D, c, "fp16")
         for D in (64, 128) for c in (False, True) for N in (1024, 2048, 4096, 8192, 16384)] + [
    ("vit-b", 64, 12, 12, 197, 64, False, "fp16"),
    ("seq-384", 48, 16, 16, 384, 64, False, "bf16"),
    ("seq-256-d128", 64, 16, 16, 256, 128, True, "bf16"),
]


def graph_samples(fn) -> list[float]:
    return timing.samples_graph(lambda: fn, 30, 60)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--cells", default="", help="comma-separated cell names (default: all)")
    args = ap.parse_args(argv)
    cells = keep_named([(c.name, c.B, c.Hq, c.Hkv, c.Nq, c.D, c.causal, c.dtype) for c in SUITES["models"]
                        if c.Nq == c.Nk and c.D <= 128 and c.B * c.Hq * c.Nq < 2 ** 22] + EXTRA, args.cells)
    sms = num_sms(torch.device("cuda"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["cell", "B", "Hq", "Hkv", "N", "D", "causal", "dtype", "variant", "config", "ms_gpu",
                    "vs_cudnn", "rel_err_vs_cudnn", "status"])
        for name, B, Hq, Hkv, N, D, causal, dtype in cells:
            p = Problem(B, Hq, N, D, dtype, causal, Hkv, N)
            q, k, v = make_inputs(p, "cuda")
            chosen = ck.select(B, Hq, Hkv, N, N, D, DTYPES[dtype], causal, 90, sms).config
            configs = {"chosen": chosen}
            if getattr(chosen, "persistent", False):
                deep = replace(chosen, deep_q=True)
                if fits(deep, D, q.element_size(), 90):
                    configs["deep_q"] = deep
            variants = {"cudnn": lambda: cudnn(q, k, v, causal)}
            for label, c in configs.items():
                variants[label] = lambda c=c: ck.attention(q, k, v, causal=causal, config=c)
            try:
                ref = variants["cudnn"]().float()
                ms = time_in_turns(variants, args.turns, graph_samples)
                for label, t in ms.items():
                    err = ((variants[label]().float() - ref).norm() / ref.norm()).item()
                    w.writerow([name, B, Hq, Hkv, N, D, int(causal), dtype, label, str(configs.get(label, "")),
                                f"{t:.5f}", f"{ms['cudnn'] / t:.4f}", f"{err:.3e}", "ok"])
                print(name, {k2: round(v2 * 1000, 1) for k2, v2 in ms.items()}, flush=True)
            except Exception as e:  # recorded, the sweep goes on
                w.writerow([name, B, Hq, Hkv, N, D, int(causal), dtype, "", "", "", "", "",
                            f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"])
            f.flush()
            del q, k, v
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
