"""A/B timing of attention variants in one process, in turns, beside SDPA cuDNN (GPU only).

The method of the A/B files in ``results/h200/experiments/``: FA-paper shapes (B·N = 16384 tokens,
H·D = 2048), each variant's warm call first, then ``turns`` rounds of ``triton.testing.do_bench``
(50 ms warm-up, 100 ms of repetitions) in alternating order (A B C, C B A, ...), the median over
all samples; outputs checked against cuDNN's. At the power cap the clocks drift by ~10 % within
seconds, and taking turns spreads that drift over every variant of a cell.
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path
from typing import Callable

import torch

GRID_N = (1024, 2048, 4096, 8192, 16384)
GRID_D = (64, 128)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def fa_paper_inputs(N: int, D: int, dtype: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v [B, H, N, D] on the GPU with B·N = 16384 and H·D = 2048."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, H = 16384 // N, 2048 // D
    return tuple(torch.randn(B, H, N, D, device="cuda", dtype=DTYPES[dtype], generator=g) for _ in range(3))


def cudnn(q, k, v, causal: bool) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def do_bench_samples(fn: Callable[[], object]) -> list[float]:
    """Every repetition's ms of ``triton.testing.do_bench`` (50 ms of warm-up, 100 ms of repetitions):
    the A/B files' original method."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=50, rep=100, return_mode="all")


def time_in_turns(variants: dict[str, Callable[[], torch.Tensor]], turns: int,
                  sample: Callable[[Callable[[], object]], list[float]] = do_bench_samples) -> dict[str, float]:
    """Median ms per call of each variant, ``sample(fn)`` taken in ``turns`` alternating rounds."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()  # compile and autotune outside the timing
    torch.cuda.synchronize()
    order = list(variants)
    for t in range(turns):
        for name in (order if t % 2 == 0 else order[::-1]):
            samples[name] += sample(variants[name])
    return {name: statistics.median(s) for name, s in samples.items()}


def run_ab(out_csv: Path, make_variants, *, baseline: str, dtypes=("fp16",), Ds=GRID_D, Ns=GRID_N,
           causals=(False, True), turns: int = 4, run: int = 1) -> None:
    """Time ``make_variants(q, k, v, causal) -> {name: fn}`` (cuDNN is added) on every cell and append
    rows ``run,dtype,D,causal,N,impl,ms,vs_cudnn,vs_<baseline>,rel_err_vs_cudnn`` to ``out_csv``."""
    new = not out_csv.exists()
    with out_csv.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(["run", "dtype", "D", "causal", "N", "impl", "ms", "vs_cudnn", f"vs_{baseline}",
                        "rel_err_vs_cudnn"])
        for dtype in dtypes:
            for D in Ds:
                for causal in causals:
                    for N in Ns:
                        q, k, v = fa_paper_inputs(N, D, dtype)
                        variants = {"cudnn": lambda: cudnn(q, k, v, causal), **make_variants(q, k, v, causal)}
                        try:
                            ref = variants["cudnn"]().float()
                            ms = time_in_turns(variants, turns)
                            for name, t in ms.items():
                                err = ((variants[name]().float() - ref).norm() / ref.norm()).item()
                                w.writerow([run, dtype, D, int(causal), N, name, f"{t:.5f}",
                                            f"{ms['cudnn'] / t:.4f}", f"{ms.get(baseline, float('nan')) / t:.4f}",
                                            f"{err:.3e}"])
                            print(dtype, D, causal, N, {n: round(t, 4) for n, t in ms.items()}, flush=True)
                        except Exception as e:  # noqa: BLE001 - recorded, the other cells go on
                            w.writerow([run, dtype, D, int(causal), N, "error", "", "", "",
                                        f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"])
                            torch.cuda.empty_cache()
                        f.flush()
