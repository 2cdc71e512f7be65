"""Tune stage C's tile configuration on this GPU and cache the winners.

    python -m stages.c_optimized.tune                      # FA-paper shapes, fp16+bf16, D 64/128
    python -m stages.c_optimized.tune --N 1024,4096 --D 64 --dtype fp16 --csv tuning.csv

For every (dtype, D, causal, N) it times each candidate of ``configs.candidate_configs`` (all of
which the tests prove correct) with ``triton.testing.do_bench`` and writes the fastest to
``tuned/<gpu-slug>.json``, which ``choose_config`` reads: under ``best`` the fastest of all, under
``best_tl`` the fastest ``tl``-kernel config (what runs with warp specialization switched off).
Candidates within ``TIE_MARGIN`` of the fastest are timed again, in turns, before one is picked:
two single-pass runs of the tuner over the same code disagreed in 4 of 40 cells, by 0.1–2.3 %
(docs/performance-log/softmax.md, entry 23), and each cell's first candidate runs once untimed
before the first pass, because a cell's first timing once read 45 % slow (entry 24). Every timing goes to the CSV too (``pass`` 1: the first, 2: timed again), so
the choice can be checked. Shapes follow the FlashAttention-paper setting: B·N = 16384 tokens,
H·D = 2048.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys

import torch

#: Candidates this much slower than the fastest (first pass) are timed again before one is picked.
TIE_MARGIN = 0.03
#: Rounds of the second timing; each round times every close candidate once, in turn.
TIE_ROUNDS = 3


def close_candidates(times_ms: dict, margin: float = TIE_MARGIN) -> list:
    """The candidates within ``margin`` of the fastest, fastest first."""
    best = min(times_ms.values())
    return sorted((c for c, ms in times_ms.items() if ms <= best * (1 + margin)), key=times_ms.get)


def pick(times_ms: dict, retime) -> tuple:
    """The winner of one cell: ``times_ms`` maps each candidate to its first-pass time; the close
    ones are timed again (``retime(candidate) -> ms``) in ``TIE_ROUNDS`` interleaved rounds, and
    the lowest median of all their times wins. A candidate whose second timing fails (it ran once,
    so this would be a fault of the run, not of the config) drops out of the choice, with a note;
    the others go on. Returns (winner, its median ms)."""
    close = close_candidates(times_ms)
    samples = {c: [times_ms[c]] for c in close}
    if len(close) > 1:
        for _ in range(TIE_ROUNDS):
            for c in [c for c in close if c in samples]:
                try:
                    samples[c].append(retime(c))
                except Exception as e:  # noqa: BLE001 - any failure of one candidate
                    print(f"  {c}: timed again, {type(e).__name__}: {str(e).splitlines()[0][:120]}; left out")
                    del samples[c]
                    if not samples:
                        raise
    medians = {c: statistics.median(v) for c, v in samples.items()}
    winner = min(medians, key=medians.get)
    return winner, medians[winner]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stages.c_optimized.tune", description=__doc__.split("\n")[0])
    ap.add_argument("--N", default="1024,2048,4096,8192,16384")
    ap.add_argument("--D", default="64,128")
    ap.add_argument("--dtype", default="fp16,bf16")
    ap.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    ap.add_argument("--csv", default=None, help="also write every timing to this CSV")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tuning needs a CUDA GPU; none found", file=sys.stderr)
        return 2

    import triton.testing

    from ..contract import DTYPES
    from . import configs
    from .kernels import attention

    arch = configs.device_arch(torch.device("cuda"))
    slug = configs.gpu_slug()
    path = configs.TUNED_DIR / f"{slug}.json"
    data = json.loads(path.read_text()) if path.exists() else configs.seed_tuning(path, "")
    data["gpu"] = torch.cuda.get_device_name()
    data.setdefault("best", {})
    data.setdefault("best_tl", {})
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    rows = []
    for dtype_name in args.dtype.split(","):
        dtype = DTYPES[dtype_name]
        for D in (int(d) for d in args.D.split(",")):
            for causal in causals:
                for N in (int(n) for n in args.N.split(",")):
                    B, H = max(1, 16384 // N), max(1, 2048 // D)
                    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(3))
                    flops = 4.0 * B * H * N * N * D / (2 if causal else 1)

                    def time_ms(config, timing_pass=2):
                        fn = lambda: attention(q, k, v, causal=causal, config=config)  # noqa: E731
                        fn()
                        ms = triton.testing.do_bench(fn, warmup=25, rep=100)
                        rows.append({"dtype": dtype_name, "D": D, "causal": int(causal), "N": N,
                                     "config": str(config), "pass": timing_pass, "ms": f"{ms:.4f}",
                                     "tflops": f"{flops / ms * 1e-9:.1f}"})
                        return ms

                    times = {}
                    candidates = configs.candidate_configs(D, dtype, arch)
                    # A cell's first timing once read 15 % slow (fp16, D = 128 causal, N = 1024), enough
                    # to drop the best config out of the tie-break; the first candidate runs once untimed.
                    _warm_up(q, k, v, causal, candidates[0])
                    for config in candidates:
                        try:
                            times[config] = time_ms(config, timing_pass=1)
                        except Exception as e:  # a config that fails to compile or launch is skipped
                            print(f"  {config}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                    # (each table under the head dim choose_config reads it by: the ws kernel's tile width, or D)
                    key = configs.tuned_key(dtype, configs.tuned_head_dim(D, dtype, arch), causal, N)
                    tl_key = configs.tuned_key(dtype, configs.tuned_head_dim(D, dtype, arch, False), causal, N)
                    tl_times = {c: ms for c, ms in times.items() if not c.ws}
                    if tl_times:
                        data["best_tl"][tl_key] = str(pick(tl_times, time_ms)[0])
                    if times:
                        best, ms = pick(times, time_ms)
                        data["best"][key] = str(best)
                        print(f"{dtype_name} D={D} causal={int(causal)} N={N}: {best} {flops / ms * 1e-9:.0f} TFLOPS"
                              f"{_cudnn_for_orientation(q, k, v, causal, flops)}", flush=True)
                    del q, k, v
    path.parent.mkdir(parents=True, exist_ok=True)
    data["arch"] = arch
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    configs.tuned_table.cache_clear()
    configs.choose_config.cache_clear()
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    print(f"wrote {path}")
    return 0


def _warm_up(q, k, v, causal: bool, config) -> None:
    """One untimed benchmark of ``config`` on these inputs (errors are left to the timed pass)."""
    import triton.testing

    from .kernels import attention

    try:
        triton.testing.do_bench(lambda: attention(q, k, v, causal=causal, config=config), warmup=25, rep=50)
    except Exception:  # noqa: BLE001 - the timed pass reports it
        pass


def _cudnn_for_orientation(q, k, v, causal: bool, flops: float) -> str:
    """PyTorch's cuDNN attention on the same inputs, printed beside the winner (not stored)."""
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ms = triton.testing.do_bench(lambda: sdpa(q, k, v, is_causal=causal), warmup=25, rep=100)
        return f"   (SDPA cuDNN {flops / ms * 1e-9:.0f})"
    except Exception as e:  # cuDNN may refuse a shape or be missing
        return f"   (SDPA cuDNN: {type(e).__name__})"


if __name__ == "__main__":
    sys.exit(main())
