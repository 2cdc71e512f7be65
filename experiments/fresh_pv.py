"""An item's accumulator started by its first P·V (``hopper_ws.FRESH_PV``, on by default) against the kernel
without it, on the model suite's cells that take the warp-specialized forward, beside cuDNN.

Why. Without it, the persistent forward starts each work item's accumulator by scaling what it held, the previous item's
O (already stored), by alpha = 0 in the softmax of the item's first tile, so the lazy rescale runs its D / 2
multiplies per thread on that tile in every warp. ``FRESH_PV`` gives that tile alpha 1 and starts the
accumulator in the P·V product instead (wgmma's scale-d false on the chain's first k-step). One tile in
N / BLOCK_N: a cell of one-tile items (``short``, 2,048 heads of 128 tokens) is where it can show. (It is
on because of what the old start does to a NaN, not for speed: ``hopper_ws.FRESH_PV``'s comment.)

Per cell (the model suite's, by name), both kernels are planned once (``kernels.plan`` with the switch off,
then on, each an output of its own) and, in rounds of turns, each launch list is timed eagerly and on the GPU
alone (CUDA-graph replay), the harness's reading flush before every repetition, beside stage C's ordinary call
(``chosen``) and cuDNN. Before the timing, the two kernels' outputs must be equal bit for bit (0 + x is x),
and the chosen call's must match float64.

    python experiments/fresh_pv.py --cells short,vit-l,bert-base,gpt2,few-heads,llama2-7b --csv <file>
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stages  # noqa: E402,F401  (before triton)
import turns  # noqa: E402  (experiments/turns.py)
from harness.peers import peer_attention  # noqa: E402
from harness.reference import reference_attention, rel_err  # noqa: E402
from stages.c_optimized import configs, hopper_ws  # noqa: E402
from stages.c_optimized import kernels as ck  # noqa: E402

HOW = ("eager", "graph")


def planned(q, k, v, causal: bool, fresh_pv: bool):
    """A call that runs the forward's launches planned once with ``FRESH_PV`` as given, into an output of
    its own (the switch is read when the launches are planned: the recipe cache is cleared around it)."""
    saved = hopper_ws.FRESH_PV
    hopper_ws.FRESH_PV = fresh_pv
    ck._recipe.cache_clear()
    ck._LAYOUT_PLANS.clear()
    try:
        o = torch.empty_like(q)
        launches = ck.plan(q, k, v, o, causal=causal, scale=q.shape[-1] ** -0.5, arch=90)
    finally:
        hopper_ws.FRESH_PV = saved
        ck._recipe.cache_clear()
        ck._LAYOUT_PLANS.clear()

    def call():
        for launch in launches:
            launch.run()
        return o

    return call, [launch.kernel.__name__ for launch in launches]


def main(argv=None) -> int:
    parsed = turns.parse(__doc__.splitlines()[0], rounds=3, argv=argv)
    if parsed is None:
        return 2
    args, cells = parsed
    sms = configs.num_sms(torch.device("cuda"))
    cudnn = peer_attention("sdpa_cudnn")
    rows = []
    turns.header(sms)
    for c in cells:
        q, k, v, choice = turns.cell_inputs(c, sms)
        print(f"\n{c.name} (B {c.B}, H {c.Hq}/{c.Hkv}, N {c.Nq}/{c.Nk}, D {c.D}, causal {int(c.causal)}): chosen "
              f"{choice.path}:{choice.config}", flush=True)
        if choice.path != "ws":
            why = f"skipped: stage C runs {choice.path}, not the warp-specialized forward, here"
            print(f"  {why}")
            rows.append(dict(cell=c.name, variant="", timing="", round="", us="", status=why))
            continue
        default, names = planned(q, k, v, c.causal, False)
        fresh, _ = planned(q, k, v, c.causal, True)
        same = torch.equal(default(), fresh())
        ref = reference_attention(q, k, v, causal=c.causal)
        err = rel_err(ck.attention(q, k, v, causal=c.causal), ref)
        del ref
        print(f"  launches {names}; fresh_pv bit for bit the default: {same}; chosen call's error against "
              f"float64 {err:.2e}", flush=True)
        if not same:
            rows.append(dict(cell=c.name, variant="fresh_pv", timing="", round="", us="",
                             status="error: output differs from the default kernel's"))
            continue
        variants = {"default": default, "fresh_pv": fresh, "chosen": lambda: ck.attention(q, k, v, causal=c.causal),
                    "cudnn": lambda: cudnn(q, k, v, causal=c.causal)}
        times = {(kind, how): [] for kind in variants for how in HOW}
        for r in range(args.rounds):
            for kind, fn in (variants.items() if r % 2 == 0 else reversed(list(variants.items()))):
                for how in HOW:
                    us, state = turns.median_us(turns.eager_or_graph(fn, how))
                    times[kind, how].append(us)
                    rows.append(dict(cell=c.name, variant=kind, timing=how, round=r, us=f"{us:.3f}", status=state))
        turns.print_medians(times, variants, HOW, width=10)
        torch.cuda.empty_cache()
    turns.write_rows(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
