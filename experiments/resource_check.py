"""Does every kernel the stages can launch fit the GPU it is launched on? A check without a GPU.

A kernel whose shared memory exceeds the block limit compiles fine and fails only at launch, on the
user's GPU ("out of resources: shared memory"); one that spills registers inside its tile loop runs,
but slowly. Both depend on the head dim (through its padded tile width), the dtype, the GPU
architecture and the path the stage picks for the shape (one-pass, split-KV decode, the
warp-specialized kernel, the backward's dK/dV and dQ kernels). This script walks the contract --
head dims 8..256, fp16/bf16/fp32, causal or not, prefill, grouped heads with Nq != Nk, decode, a
tiny grid, forward, the training forward (which also stores the log-sum-exp) and both backward
flavours -- plans every launch each stage would make for sm_80 and sm_90, compiles each distinct
kernel once with Triton (no GPU needed), assembles it with ptxas, and reports its shared memory,
registers and spills against the architecture's limits. Over a limit (a launch would fail): a
compile or ptxas error, shared memory past the block's maximum. Spills are reported beside, as a
cost: the kernel runs, slower.

    python experiments/resource_check.py                      # everything (about 20 min on 2 cores)
    python experiments/resource_check.py --arch 90 --D 256 --dtype bf16 --csv out.csv

Exit status 1 if any kernel is over a limit (spills alone do not fail it). The test suite runs a small slice of it
(tests/test_resource_check.py).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Compile in this process (the interpreter off), so every launch passes through DistinctCompiles;
# with the interpreter on, a stage's compile() would hand the work to a child process.
os.environ["TRITON_INTERPRET"] = "0"

import stages  # noqa: E402  (before triton: chooses the interpreter off a GPU)
from harness.inspect_code import run_ptxas  # noqa: E402
from stages import STAGES, launch  # noqa: E402
from stages.c_optimized import backward as c_backward  # noqa: E402
from stages.c_optimized.configs import SHARED_MEMORY_LIMIT  # noqa: E402
from stages.contract import HEAD_DIMS, CompiledKernel, Problem  # noqa: E402

#: Spill bytes ptxas may report before a kernel counts as spilling: a value or two kept on the
#: stack outside the tile loops (tests/test_compiled_code.py finds where the spills are).
SPILL_TOLERANCE_BYTES = 16

#: Shapes that send stage C down each of its paths: one-pass prefill, grouped heads with a longer
#: key sequence, single-query decode (split-KV), a grid too small to fill the GPU (shape-aware tiles),
#: and a few query rows against many keys (split-KV outside decoding: its own tiles).
SHAPES = {
    "prefill": dict(B=2, H=8, N=1000),
    "gqa-cross": dict(B=2, H=8, N=300, Hkv=2, Nk=700),
    "decode": dict(B=4, H=8, N=1, Hkv=2, Nk=8192),
    "tiny": dict(B=1, H=1, N=64),
    "long-keys": dict(B=1, H=2, N=128, Nk=65536),
}


@dataclass
class Checked:
    stage: str
    arch: int
    dtype: str
    D: int
    kernel: str
    num_warps: int
    num_stages: int
    shared_bytes: int
    shared_limit: int
    registers: int | None
    spill_bytes: int | None
    error: str = ""
    example: str = ""

    @property
    def over(self) -> list[str]:
        """What would make a launch fail: a compile or ptxas error, shared memory over the limit."""
        out = []
        if self.error:
            out.append(self.error)
        if self.shared_bytes > self.shared_limit:
            out.append(f"shared memory {self.shared_bytes} B > {self.shared_limit} B")
        return out

    @property
    def spills(self) -> bool:
        """Runs, but slower: ptxas moved registers to local memory beyond the tolerance."""
        return self.spill_bytes is not None and self.spill_bytes > SPILL_TOLERANCE_BYTES


def launch_key(one: launch.Launch, arch: int) -> tuple:
    """What makes two launches compile to the same binary: the kernel, its specialization (argument
    types, constexprs, 16-byte alignment: ``Launch.specialization``) and the launch options."""
    signature, constexprs, attrs = one.specialization()
    return (one.kernel.__name__, arch, one.num_warps, one.num_stages, tuple(sorted(one.extra.items())),
            tuple(signature.items()), repr(sorted(constexprs.items())), repr(sorted(attrs.items())))


class DistinctCompiles:
    """Replaces ``Launch.compile`` while active: each distinct launch is compiled and assembled
    once, and recorded with the first problem that needed it."""

    def __init__(self):
        self.seen: dict[tuple, Checked] = {}
        self.current = ("", "", 0)  # (stage, example, head dim) being planned

    def __enter__(self):
        self._original = launch.Launch.compile
        checker = self

        def compile_once(one, arch):
            key = launch_key(one, arch)
            if key not in checker.seen:
                checked = checker.seen[key] = checker._check(one, arch)
                if checked.over:
                    print(f"  OVER: sm_{arch} {checked.stage} {checked.kernel} ({checked.example}): "
                          f"{'; '.join(checked.over)}", flush=True)
                elif checked.spills:
                    print(f"  spills {checked.spill_bytes} B: sm_{arch} {checked.stage} {checked.kernel} "
                          f"({checked.example})", flush=True)
            return checker._stub

        launch.Launch.compile = compile_once
        self._stub = CompiledKernel(name="", asm={}, shared_bytes=0, num_warps=0, num_stages=0)
        return self

    def __exit__(self, *exc):
        launch.Launch.compile = self._original

    def _check(self, one: launch.Launch, arch: int) -> Checked:
        stage, example, D = self.current
        dtype = next((str(v.dtype).replace("torch.", "") for v in one.args.values() if hasattr(v, "dtype")), "")
        base = dict(stage=stage, arch=arch, dtype=dtype, D=D, kernel=one.kernel.__name__,
                    num_warps=one.num_warps, num_stages=one.num_stages, shared_limit=SHARED_MEMORY_LIMIT[arch],
                    example=example)
        try:
            compiled = self._original(one, arch)
        except Exception as e:  # noqa: BLE001  (a kernel that does not compile is a finding, not a crash)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return Checked(**base, shared_bytes=0, registers=None, spill_bytes=None, error=first[:200])
        facts = run_ptxas(compiled.asm["ptx"])  # assembled for the PTX's own target (sm_80, sm_90a)
        spills = None if facts.get("spill_stores") is None else facts["spill_stores"] + facts["spill_loads"]
        return Checked(**base, shared_bytes=compiled.shared_bytes, registers=facts.get("registers"),
                       spill_bytes=spills, error=facts.get("ptxas_error", ""))


def problems(head_dims, dtypes, shapes):
    for D in head_dims:
        for dtype in dtypes:
            for causal in (False, True):
                for shape_name in shapes:
                    yield shape_name, Problem(D=D, dtype=dtype, causal=causal, **SHAPES[shape_name])


def plan_everything(checker: DistinctCompiles, archs, head_dims, dtypes, shapes, stage_names, progress=print):
    """Plan (and so compile, once each) every launch of the stages over the problems."""
    started = time.time()
    for arch in archs:
        for shape_name, p in problems(head_dims, dtypes, shapes):
            example = f"{shape_name} D={p.D} {p.dtype} {'causal' if p.causal else 'full'} sm_{arch}"
            for name in stage_names:
                checker.current = (name, example, p.D)
                stage = STAGES[name]
                if name == "c":
                    stage.compile(p, arch)
                    stage.compile(p, arch, store_lse=True)
                    if p.N > 1:  # decode takes no backward in the lab's training path; prefill does
                        for deterministic in (False, True):
                            c_backward.compile_backward(p, arch, deterministic=deterministic)
                else:
                    for method in ("separate", "atomic") if name == "b" else (None,):
                        kwargs = {"dq_method": method} if method else {"backward": True}
                        stage.compile(p, arch, **kwargs)
            progress(f"[{time.time() - started:6.0f} s] {example}: {len(checker.seen)} distinct kernels so far",
                     flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="80,90", help="comma-separated: 80, 90 (default both)")
    parser.add_argument("--D", default=None,
                        help="comma-separated head dims (default: one per padded tile width and the "
                             "odd ones models use: 8,16,24,32,48,64,80,96,128,160,200,256)")
    parser.add_argument("--dtype", default="fp16,bf16,fp32")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated from {list(SHAPES)}")
    parser.add_argument("--stages", default="a,b,c")
    parser.add_argument("--csv", default=None, help="write one row per distinct kernel here")
    args = parser.parse_args(argv)

    def parse_list(text, allowed, what, cast=str):
        try:
            values = [cast(x) for x in text.split(",") if x]
        except ValueError:
            parser.error(f"--{what}: expected a comma-separated list of {allowed}, got {text!r}")
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            parser.error(f"--{what}: {bad or text!r} not among {list(allowed)}")
        return values

    archs = parse_list(args.arch, (80, 90), "arch", int)
    head_dims = parse_list(args.D or "8,16,24,32,48,64,80,96,128,160,200,256", HEAD_DIMS, "D", int)
    dtypes = parse_list(args.dtype, ("fp16", "bf16", "fp32"), "dtype")
    shapes = parse_list(args.shapes, tuple(SHAPES), "shapes")
    stage_names = parse_list(args.stages, ("a", "b", "c"), "stages")

    with DistinctCompiles() as checker:
        plan_everything(checker, archs, head_dims, dtypes, shapes, stage_names)
    rows = list(checker.seen.values())
    bad = [r for r in rows if r.over]
    spilling = [r for r in rows if r.spills and not r.over]
    for r in sorted(rows, key=lambda r: (r.arch, r.stage, r.kernel, r.dtype, r.D)):
        flag = "; ".join(r.over) or ("spills" if r.spills else "ok")
        print(f"sm_{r.arch} {r.stage} {r.kernel:34s} {r.dtype:8s} D={r.D:<4d} warps={r.num_warps} stages={r.num_stages} "
              f"smem={r.shared_bytes:>7d}/{r.shared_limit} regs={r.registers} spills={r.spill_bytes}  {flag}")
    if args.csv:
        try:
            with open(args.csv, "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow([*Checked.__dataclass_fields__, "over", "spills"])
                for r in rows:
                    writer.writerow([*(getattr(r, k) for k in Checked.__dataclass_fields__), "; ".join(r.over),
                                     int(r.spills)])
        except OSError as e:
            print(f"error: cannot write --csv {args.csv}: {e.strerror or e}", file=sys.stderr)
            return 2
    for r in bad:
        print(f"  OVER: sm_{r.arch} {r.stage} {r.kernel} {r.dtype} D={r.D} ({r.example}): {'; '.join(r.over)}")
    print(f"{len(rows)} distinct kernels, {len(spilling)} spilling more than {SPILL_TOLERANCE_BYTES} B, "
          f"{len(bad)} over a limit")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
