"""What each step changes in the compiled code, read from the PTX and TTGIR Triton writes for sm_90
and sm_80 (no GPU needed).

Every step is compiled as the stage compiles it (``kernels.compile``: the same plan a call runs),
at one cell (``ladder.FACTS_CELL``): for sm_90 with the H200's tuning table, as the ablation rows
ran; for sm_80 with the configs stage C takes without a tuning table (it has none for an A100), the
``tl`` steps only (the warp-specialized kernel is Hopper's). Counts are static: instructions in
the code after unrolling, not instructions executed.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import triton

from harness import inspect_code
from harness.inspect_code import _opcodes, count_instructions, run_ptxas

from ...contract import CompiledKernel, Problem
from ...launch import compiles_without_interpreter
from .. import VARIANTS, kernels
from .ladder import FACTS_CELL, STEPS, TL_FUNCTIONS, TUNED_SLUG, Cell, Step, kernel_name, launch, tuned_for
from .resolve import function_sources

STEPS_BY_VARIANT = {s.variant: s for s in STEPS}

#: (key, label) of the facts shown for every step, in display order; "ptx:<prefix>" counts PTX
#: instructions (``harness.inspect_code.count_instructions``' keys), "ttgir:<op>" TTGIR operations.
FACT_KEYS = (
    ("kernel", "kernel"),
    ("num_warps", "warps"),
    ("num_stages", "num_stages"),
    ("shared_bytes", "shared memory, bytes"),
    ("registers", "registers per thread (ptxas)"),
    ("spill_bytes", "spill stores + loads, bytes"),
    ("ptx:ld.global.v4", "`ld.global.v4` (16-byte loads)"),
    ("ptx:cp.async.cg.shared.global", "`cp.async.cg.shared.global`"),
    ("ptx:cp.async.commit_group", "`cp.async.commit_group`"),
    ("ptx:cp.async.wait_group", "`cp.async.wait_group`"),
    ("ptx:cp.async.bulk.tensor", "`cp.async.bulk.tensor` (TMA)"),
    ("ptx:mbarrier", "`mbarrier.*`"),
    ("ptx:mma.sync", "`mma.sync`"),
    ("ptx:ldmatrix", "`ldmatrix`"),
    ("ptx:wgmma.mma_async", "`wgmma.mma_async`"),
    ("ptx:ex2.approx", "`ex2.approx`"),
    ("op:mul.f32", "`mul.f32`"),
    ("op:selp.f32", "`selp.f32` (mask selects)"),
    ("op:setmaxnreg", "`setmaxnreg`"),
    ("ptx:bar.sync", "`bar.sync`"),
    ("ttgir:scf.for", "TTGIR `scf.for` loops"),
    ("ttgir:arith.select", "TTGIR `arith.select`"),
)

#: the PTX opcodes whose counts a step changed most, listed per step
TOP_CHANGES = 6


@compiles_without_interpreter
def compile_steps(problem: Problem, arch: int, *, variants: list, slug: str | None) -> list[CompiledKernel]:
    """Each of ``variants`` compiled for sm_``arch`` at ``problem``, with the configs stage C picks on
    the GPU of tuning table ``slug`` (one kernel per variant). Runs in a child process with the
    interpreter off when this one interprets."""
    out = []
    with tuned_for(slug):
        for variant in variants:
            (kernel,) = kernels.compile(problem, arch, **VARIANTS[variant])
            out.append(kernel)
    return out


def _opcode_counts(ptx: str) -> Counter:
    """Counts of every PTX opcode, by its full name (``ex2.approx.ftz.f32``, ``mul.f32``)."""
    return Counter(_opcodes(ptx))


def kernel_facts(kernel: CompiledKernel, ptxas: dict) -> dict:
    """The :data:`FACT_KEYS` of one compiled kernel (plus ``opcodes``: every PTX opcode's count)."""
    ptx, ttgir = kernel.asm.get("ptx", ""), kernel.asm.get("ttgir", "")
    counts = count_instructions(ptx)
    opcodes = _opcode_counts(ptx)
    facts = {"kernel": kernel.name, "num_warps": kernel.num_warps, "num_stages": kernel.num_stages,
             "shared_bytes": kernel.shared_bytes, "registers": ptxas.get("registers"),
             "spill_bytes": None if ptxas.get("spill_stores") is None
             else ptxas["spill_stores"] + (ptxas.get("spill_loads") or 0)}
    for key, _ in FACT_KEYS:
        kind, _, name = key.partition(":")
        if kind == "ptx":
            facts[key] = counts[name]
        elif kind == "op":
            facts[key] = sum(n for op, n in opcodes.items() if op == name or op.startswith(name + "."))
        elif kind == "ttgir":
            facts[key] = len(re.findall(rf"\b{re.escape(name)}\b", ttgir))
    facts["opcodes"] = dict(opcodes)
    return facts


def _problem(cell: Cell) -> Problem:
    return Problem(cell.B, cell.H, cell.N, cell.D, cell.dtype, cell.causal)


def _slug(arch: int) -> str | None:
    """The tuning table each architecture compiles with: the H200's for sm_90, none for sm_80."""
    return TUNED_SLUG if arch == 90 else None


def wanted(steps: tuple[Step, ...] = STEPS) -> list[tuple[str, int]]:
    """(variant, arch) of every compile the pages show: sm_90 for every step, sm_80 for the tl ones."""
    return [(s.variant, a) for s in steps for a in (90, 80) if a == 90 or not s.is_ws]


def compile_facts(pairs: list[tuple[str, int]], cell: Cell = FACTS_CELL) -> dict[tuple[str, int], dict]:
    """{(variant, arch): facts} for the given compiles. One child process per architecture (under
    the interpreter), the two in parallel; then ptxas reads registers and spills of each kernel."""
    jobs = [(arch, [v for v, a in pairs if a == arch]) for arch in (90, 80)]
    jobs = [(arch, variants) for arch, variants in jobs if variants]
    with ThreadPoolExecutor(max_workers=2) as pool:
        compiled = list(pool.map(
            lambda job: compile_steps(_problem(cell), job[0], variants=job[1], slug=_slug(job[0])), jobs))
        done = [((variant, arch), k) for (arch, variants), ks in zip(jobs, compiled)
                for variant, k in zip(variants, ks)]
        ptxas = list(pool.map(lambda item: run_ptxas(item[1].asm["ptx"]), done))
    return {key: kernel_facts(kernel, regs) for (key, kernel), regs in zip(done, ptxas)}


# --------------------------------------------------------------------------------------------------
# The cache: compiling every step takes a minute or more, so the facts are kept, committed, beside
# the pages, each under a fingerprint of everything its compile depends on. The generator compiles
# only what has no matching fingerprint; the test recomputes the fingerprints (no compiler needed)
# and compiles one step to check the cache against the compiler.
# --------------------------------------------------------------------------------------------------

CACHE_NAME = "compiled-facts.json"
_HERE = Path(__file__).resolve().parent
_KERNELS_PY = _HERE.parent / "kernels.py"
_HOPPER_WS_PY = _HERE.parent / "hopper_ws.py"


def _describe(value) -> str:
    """An argument as its compile sees it: a tensor by dtype, shape and strides; a TMA descriptor by
    its fields; anything else by repr."""
    if isinstance(value, torch.Tensor):
        return f"tensor({value.dtype}, {tuple(value.shape)}, {value.stride()})"
    if hasattr(value, "block_shape"):
        fields = {k: v for k, v in vars(value).items() if k != "base"}
        described = sorted((k, repr(v)) for k, v in fields.items())
        return f"{type(value).__name__}({described}, base={_describe(value.base)})"
    return repr(value)


def fingerprint(step: Step, arch: int, cell: Cell = FACTS_CELL) -> str:
    """A hash of what the compile of ``step`` for sm_``arch`` depends on: the kernel's source (the
    ``tl`` kernel's functions, or all of ``hopper_ws.py``), every launch argument as the compiler
    sees it, the launch options, the Triton version and the code that counts the facts."""
    one, _ = launch(step, cell, arch=arch, slug=_slug(arch))
    if step.is_ws:
        source = _HOPPER_WS_PY.read_text()
    else:
        source = "".join(function_sources(_KERNELS_PY.read_text(), TL_FUNCTIONS).values())
    parts = [triton.__version__, arch, kernel_name(one.kernel), source,
             sorted((k, _describe(v)) for k, v in one.args.items()), one.num_warps, one.num_stages,
             sorted(one.extra.items()), inspect.getsource(inspect_code), Path(__file__).read_text()]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:20]


class StaleFacts(LookupError):
    """The committed compiled facts do not match the code: regenerate them."""


def load_cache(out_dir: Path) -> dict:
    path = Path(out_dir) / CACHE_NAME
    return json.loads(path.read_text()) if path.exists() else {}


def facts_for(out_dir: Path, *, recompile: bool = False, may_compile: bool = True) -> tuple[dict, dict]:
    """({variant: {arch: facts}} for every step, the cache file's new content). Reuses the cached
    facts whose fingerprint matches; compiles the rest (all with ``recompile``), or, with
    ``may_compile=False``, raises :class:`StaleFacts` naming them."""
    cached = {} if recompile else load_cache(out_dir).get("steps", {})
    prints = {(v, a): fingerprint(STEPS_BY_VARIANT[v], a) for v, a in wanted()}
    fresh = {key: cached[key[0]][str(key[1])]["facts"] for key, fp in prints.items()
             if cached.get(key[0], {}).get(str(key[1]), {}).get("fingerprint") == fp}
    missing = [key for key in prints if key not in fresh]
    if missing and not may_compile:
        names = ", ".join(f"{v} sm_{a}" for v, a in missing)
        raise StaleFacts(f"the compiled facts of {names} in {Path(out_dir) / CACHE_NAME} do not match the code: "
                         f"run `python -m stages.c_optimized.steps`")
    if missing:
        fresh.update(compile_facts(missing))
    facts: dict = {s.variant: {} for s in STEPS}
    for (v, a) in prints:
        facts[v][a] = fresh[(v, a)]
    cache = {"generated_by": "python -m stages.c_optimized.steps (do not edit)",
             "what": "compiled-code facts of each step at B 4, H 16, N 4096, D 128, causal, fp16 "
                     "(stages/c_optimized/steps/facts.py), each under a fingerprint of what its compile reads",
             "steps": {v: {str(a): {"fingerprint": prints[(v, a)], "facts": facts[v][a]}
                           for a in sorted(facts[v], reverse=True)} for v in facts}}
    return facts, cache


def cache_text(cache: dict) -> str:
    return json.dumps(cache, indent=1, sort_keys=True) + "\n"


def top_changes(before: dict | None, after: dict, n: int = TOP_CHANGES) -> list[tuple[str, int, int]]:
    """The ``n`` PTX opcodes whose static count changed most from ``before`` to ``after``:
    (opcode, count before, count after), largest change first (ties by name)."""
    if before is None:
        return []
    a, b = before["opcodes"], after["opcodes"]
    changed = [(op, a.get(op, 0), b.get(op, 0)) for op in set(a) | set(b) if a.get(op, 0) != b.get(op, 0)]
    changed.sort(key=lambda c: (-abs(c[2] - c[1]), c[0]))
    return changed[:n]


__all__ = ["CACHE_NAME", "FACT_KEYS", "StaleFacts", "cache_text", "compile_facts", "compile_steps", "facts_for",
           "fingerprint", "kernel_facts", "load_cache", "top_changes", "wanted"]
