"""Which of stage C's paths and tile configs is fastest on each model-shape cell, and on cells that
are in neither the suite nor the tuning grid: the data behind the shape-aware choice in
``stages/c_optimized/configs.py`` and ``decode.py``.

For every cell it times, on the GPU alone (CUDA-graph replay, so the host path does not blur the
kernels' differences), stage C as it chooses today, then every tile config it could take
(``candidate_configs``, the warp-specialized ones too where they apply; where the choice is the
``tl`` kernel, its tiles at one and two pipeline stages too), then the split-KV path at several
split counts, and cuDNN beside them. One CSV row per (cell, candidate).

    python experiments/suite_configs.py --out results/h200/experiments/2026-12-01_suite_configs.csv
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stages  # noqa: E402,F401  (before triton)
from harness import timing  # noqa: E402
from harness.inputs import make_inputs  # noqa: E402
from harness.peers import peer_attention  # noqa: E402
from harness.suites import SUITES  # noqa: E402
from stages.c_optimized import candidate_configs  # noqa: E402
from stages.c_optimized import kernels as ck  # noqa: E402
from stages.c_optimized.configs import num_sms  # noqa: E402
from stages.contract import DTYPES, Problem  # noqa: E402

#: shapes in neither the suite nor the grid (B, Hq, Hkv, Nq, Nk, D, causal, dtype)
EXTRA = [
    ("b1-h4-n4096", 1, 4, 4, 4096, 4096, 64, False, "fp16"),
    ("vit-b", 64, 12, 12, 197, 197, 64, False, "fp16"),
    ("d256-b2", 2, 8, 8, 4096, 4096, 256, False, "bf16"),
    ("mistral-decode", 8, 32, 8, 1, 16384, 128, False, "bf16"),
    ("qwen-d128-gqa7", 2, 28, 4, 3000, 3000, 128, True, "bf16"),
    ("d72-cross", 4, 16, 16, 300, 2000, 72, False, "fp16"),
    ("decode-b1-gqa-4k", 1, 32, 8, 1, 4096, 128, False, "bf16"),
    ("decode-b1-gqa-32k", 1, 32, 8, 1, 32768, 128, False, "bf16"),
]


def keep_named(cells: list, names: str) -> list:
    """The cells (tuples, the name first) named in the comma-separated ``names``; all when it is empty."""
    if not names:
        return cells
    keep = set(names.split(","))
    return [c for c in cells if c[0] in keep]


def graph_ms(fn) -> float | None:
    try:
        return timing.summarize(timing.samples_graph(lambda: fn, 50, 60), True).ms_median
    except Exception:
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cells", default="", help="comma-separated cell names (default: all)")
    args = ap.parse_args(argv)
    cells = keep_named([(c.name, c.B, c.Hq, c.Hkv, c.Nq, c.Nk, c.D, c.causal, c.dtype) for c in SUITES["models"]]
                       + EXTRA, args.cells)
    sms = num_sms(torch.device("cuda"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["cell", "B", "Hq", "Hkv", "Nq", "Nk", "D", "causal", "dtype", "candidate", "path", "ms_gpu",
                    "status"])
        for name, B, Hq, Hkv, Nq, Nk, D, causal, dtype in cells:
            if B * Hq * Nq * Nk > 2 ** 34:  # the long-context cell: one path, minutes of timing
                continue
            p = Problem(B, Hq, Nq, D, dtype, causal, Hkv, Nk)
            q, k, v = make_inputs(p, "cuda")
            cands = [("chosen", {})]
            cands += [(str(c), {"config": c}) for c in candidate_configs(D, DTYPES[dtype], 90)]
            chosen = ck.select(B, Hq, Hkv, Nq, Nk, D, DTYPES[dtype], causal, 90, sms)
            if chosen.path == "tl":  # the chosen tiles at shallower pipelines (a cell of a tile or two)
                cands += [(f"{chosen.config.with_stages(s)}", {"config": chosen.config.with_stages(s)})
                          for s in (1, 2) if s < chosen.config.num_stages]
            cands += [(f"split{s}", {"split_kv": s}) for s in (2, 4, 8, 16, 32, 64, 128, 256)]
            cands += [("cudnn", None)]
            for label, kw in cands:
                try:
                    if kw is None:
                        fn0 = peer_attention("sdpa_cudnn")
                        fn = lambda: fn0(q, k, v, causal=causal)  # noqa: E731
                        path = "peer"
                    else:
                        fn = lambda kw=kw: ck.attention(q, k, v, causal=causal, **kw)  # noqa: E731
                        choice = ck.select(B, Hq, Hkv, Nq, Nk, D, DTYPES[dtype], causal, 90, sms,
                                           **{k2: v2 for k2, v2 in kw.items()})
                        path = f"{choice.path}:{choice.config}"
                        if choice.path == "split":  # which merge kernel shape ran (LAB_DECODE_MERGE)
                            path += f" merge={ck.decode.MERGE}"
                    fn()
                    torch.cuda.synchronize()
                    ms = graph_ms(fn)
                    w.writerow([name, B, Hq, Hkv, Nq, Nk, D, int(causal), dtype, label, path,
                                f"{ms:.5f}" if ms else "", "ok"])
                except Exception as e:  # a candidate that does not apply here: recorded, not fatal
                    w.writerow([name, B, Hq, Hkv, Nq, Nk, D, int(causal), dtype, label, "", "",
                                f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"])
                f.flush()
            best = None
            print(f"{name}: done", flush=True)
            del q, k, v, best
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
