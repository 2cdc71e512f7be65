"""Switches of the Hopper dK/dV kernel, off and on, timed as whole backwards in turns beside cuDNN's.

A module switch of ``stages/c_optimized/hopper_bwd.py`` (a bool such as ``JOINED_ROW_STATS`` or
``EARLY_SLOT_RELEASE``) changes the kernel it compiles. This times stage C's whole backward
(``backward.attention_backward``, the default plan: Δ pre-pass, dK/dV with fused dQ or the dQ kernel,
the cast) once per variant, a variant being a set of switches, and SDPA's cuDNN backward, at the model
suite's cells (``harness.suites.MODELS``, by name) and at FlashAttention-paper cells (``fa-d64``,
``fa-d128-causal``: B·N = 16384 tokens, H·D = 2048, N = ``--N``). Per cell every variant's gradients are
checked against the first variant's (dK and dV to rounding, dQ to fused dQ's summation order), then
``--rounds`` rounds of ``harness.timing.samples_gpu`` (the harness's method: an L2 flush before every
repetition) go round the variants and cuDNN in turns, so clock drift at the power cap falls on all of
them; the median of the pooled samples is the row's time.

    python experiments/backward_switches.py --csv results/<gpu>/experiments/<date>_backward_switches.csv
    python experiments/backward_switches.py --cells bert-base,fa-d64 --switches JOINED_ROW_STATS
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import stages  # noqa: E402,F401
import torch  # noqa: E402

from harness.suites import MODELS  # noqa: E402
from harness.timing import samples_gpu  # noqa: E402
from stages.c_optimized import backward as bwd  # noqa: E402
from stages.c_optimized import hopper_bwd  # noqa: E402
from stages.c_optimized.configs import device_arch  # noqa: E402
from stages.c_optimized.tune_backward import _write_csv  # noqa: E402

from fused_dq import relative_difference  # noqa: E402  (this folder: max |a - b| over max |b|, per gradient)
from backward_spills import bool_flags  # noqa: E402  (this folder: names of hopper_bwd's bool flags, checked)

#: The suite's cells this backward runs as one K/V tile per program (Nq == Nk; the decoding-shaped
#: ones take the split backward, which has none of these switches).
DEFAULT_CELLS = ("bert-base", "vit-l", "few-heads", "short", "gpt2", "odd-n", "llama2-7b", "llama3-8b",
                 "vit-h-d80", "phi-d96", "fa-d64", "fa-d64-causal", "fa-d128", "fa-d128-causal")


def cell_shape(name: str, N: int) -> dict:
    """B, Hq, Hkv, N, D, causal, dtype of a suite cell or of ``fa-d<D>[-causal]``."""
    if name.startswith("fa-d"):
        D = int(name[4:].split("-")[0])
        return dict(B=max(1, 16384 // N), Hq=2048 // D, Hkv=2048 // D, N=N, D=D, causal=name.endswith("-causal"),
                    dtype="bf16")
    for c in MODELS:
        if c.name == name:
            if c.Nq != c.Nk:
                raise ValueError(f"cell {name!r} has Nq != Nk: the split backward, none of these switches")
            return dict(B=c.B, Hq=c.Hq, Hkv=c.Hkv, N=c.Nq, D=c.D, causal=c.causal, dtype=c.dtype)
    raise ValueError(f"unknown cell {name!r}: a name of harness.suites.MODELS or fa-d<D>[-causal]")


def make_inputs(shape: dict):
    """q, k, v, o, lse, do of the cell (fixed seed), the forward by stage C."""
    from stages.c_optimized.kernels import attention_with_lse
    from stages.contract import DTYPES

    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = DTYPES[shape["dtype"]]
    B, Hq, Hkv, N, D = (shape[k] for k in ("B", "Hq", "Hkv", "N", "D"))
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    o, lse = attention_with_lse(q, k, v, causal=shape["causal"])
    return q, k, v, o, lse, torch.randn_like(o)


def stage_c(tensors, causal: bool, switches: dict):
    """The default backward planned with ``switches`` set on ``hopper_bwd`` (then reset), and a call
    that runs it again: ``attention_backward`` keeps a layout's planned launches (``backward._KEPT``,
    the kernels compiled with the switches), and the call puts this variant's back before each run."""
    q, k, v, o, lse, do = tensors
    scale = q.shape[-1] ** -0.5
    saved = {n: getattr(hopper_bwd, n) for n in switches}
    for n, on in switches.items():
        setattr(hopper_bwd, n, on)
    bwd._KEPT.clear()  # (launches planned with other switches)
    try:
        grads = bwd.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale)
        bwd.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale)  # (the kept path's first run)
    finally:
        for n, on in saved.items():
            setattr(hopper_bwd, n, on)
    kept = dict(bwd._KEPT)

    def run():
        bwd._KEPT.clear()
        bwd._KEPT.update(kept)
        return bwd.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale)

    return grads, run


def cudnn(tensors, causal: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, o, lse, do = tensors
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        oo = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal,
                                                              enable_gqa=q.shape[1] != k.shape[1])
    return lambda: torch.autograd.grad(oo, (qq, kk, vv), do, retain_graph=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default=",".join(DEFAULT_CELLS),
                    help="suite cell names (harness.suites.MODELS, Nq == Nk) and fa-d<D>[-causal]")
    ap.add_argument("--N", type=int, default=4096, help="N of the fa-* cells")
    ap.add_argument("--switches", default="PREFETCH_ROW_STATS",
                    help="bool flags of stages/c_optimized/hopper_bwd.py; the variants are: all off, then each "
                         "switched on in turn cumulatively (off, +first, +first+second, ...)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)
    names = bool_flags(ap, "--switches", args.switches)
    try:
        shapes = {c: cell_shape(c, args.N) for c in args.cells.split(",") if c}
    except ValueError as e:
        ap.error(f"--cells: {e}")
    if not torch.cuda.is_available() or device_arch(torch.device("cuda")) != 90:
        print("backward_switches.py needs an sm_90 GPU (the Hopper backward kernels)", file=sys.stderr)
        return 2
    variants = {"off": {n: False for n in names}}
    for i, n in enumerate(names):
        variants["+" + "+".join(names[:i + 1]).lower()] = {m: j <= i for j, m in enumerate(names)}
    rows: list[dict] = []
    for cell, shape in shapes.items():
        base = dict(cell=cell, **shape)
        try:
            tensors = make_inputs(shape)
            fns, ref = {}, None
            for vname, switches in variants.items():
                grads, fns[vname] = stage_c(tensors, shape["causal"], switches)
                torch.cuda.synchronize()
                if ref is None:
                    ref = grads
                else:
                    diffs = relative_difference(grads, ref)  # dq, dk, dv
                    if not (diffs[0] < 2e-2 and max(diffs[1:]) < 1e-2):
                        rows.append({**base, "variant": vname, "ms": "", "status": "wrong: relative difference "
                                     + " ".join(f"{d:.2e}" for d in diffs)})
                        del fns[vname]
            fns["cudnn"] = cudnn(tensors, shape["causal"])
            samples = {n: [] for n in fns}
            for r in range(args.rounds):
                order = list(fns) if r % 2 == 0 else list(reversed(fns))
                for n in order:
                    fn = fns[n]
                    fn()
                    samples[n] += samples_gpu(fn, warmup_ms=25, rep_ms=100)
            for n, t in samples.items():
                rows.append({**base, "variant": n, "ms": round(statistics.median(t), 5), "status": "ok"})
            print(f"{cell}: " + ", ".join(f"{n} {statistics.median(t) * 1e3:.1f} us" for n, t in samples.items()),
                  flush=True)
        except Exception as e:  # noqa: BLE001 - a cell that fails is recorded, the rest go on
            rows.append({**base, "variant": "", "ms": "", "status": f"error: {type(e).__name__}: "
                         + (str(e).splitlines()[0][:160] if str(e) else "")})
            print(f"{cell}: {rows[-1]['status']}", flush=True)
            torch.cuda.empty_cache()
        _write_csv(args.csv, rows)  # after every cell: a crash keeps what was measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
