"""Stage C's step pages (docs/stage-c-steps/, ``python -m stages.c_optimized.steps``): they are what
the generator writes now, so they cannot drift from the kernels or the results; each step's resolved
kernel is Python that defines a ``@triton.jit`` kernel, and two of them compute what the stage
computes, bit for bit, and what a float64 reference computes."""

from __future__ import annotations

import ast
import csv
import importlib.util
import inspect
import sys
from pathlib import Path

import pytest
import torch

from stages.c_optimized import VARIANTS, kernels
from stages.c_optimized.steps import ladder, render
from stages.c_optimized.steps import facts as facts_mod
from stages.c_optimized.steps.__main__ import differences, generate
from stages.c_optimized.steps.ladder import CELLS, STEPS, SWITCH_CONSTEXPRS
from stages.c_optimized.steps.resolve import resolve_branches, resolve_functions

sys.path.insert(0, str(Path(__file__).parent))
from helpers import check_against_reference, make_qkv  # noqa: E402

TL_STEPS = [s for s in STEPS if not s.is_ws]
BY_VARIANT = {s.variant: s for s in STEPS}


def test_the_committed_pages_are_what_the_generator_writes():
    """Regenerate everything in memory (the compiled facts from the committed cache, whose
    fingerprints must match the code) and compare with docs/stage-c-steps/."""
    files = generate(render.OUT_DIR, may_compile=False)
    assert differences(render.OUT_DIR, files) == [], f"run `{render.COMMAND}`"


def test_the_steps_are_the_ablation_walk():
    assert [s.variant for s in STEPS] == [v for v in VARIANTS if v.startswith("+")]
    assert [s.is_ws for s in STEPS] == [False] * 6 + [True] * 6
    assert [s.rung for s in STEPS if s.is_ws] == list(range(1, 7))


def test_the_switch_constexprs_are_all_the_tl_steps_change_in_the_kernel():
    """A step view resolves SWITCH_CONSTEXPRS; any other constexpr a step changed (but the tile
    sizes, which are the config) would be left unresolved in the pages."""
    varying = set()
    for cell in CELLS:
        seen = [ladder.launch(s, cell)[0].args for s in TL_STEPS]
        for name, value in seen[0].items():
            if name.isupper() and not isinstance(value, torch.Tensor) and any(a[name] != value for a in seen):
                varying.add(name)
    assert varying - {"BLOCK_M", "BLOCK_N"} == set(SWITCH_CONSTEXPRS)


def _import(tmp_path: Path, step) -> object:
    path = tmp_path / f"step_{step.file_stem}.py"
    path.write_text(render.kernel_module(step))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("step", TL_STEPS, ids=lambda s: s.variant)
def test_each_resolved_step_is_python_defining_a_jit_kernel(step, tmp_path):
    source = render.kernel_module(step)
    tree = ast.parse(source)
    kernel = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "optimized_attention_kernel")
    assert any(ast.unparse(d).startswith("triton.jit") for d in kernel.decorator_list)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {a.arg for a in ast.walk(tree)
                                                                        if isinstance(a, ast.arg)}
    assert not names & set(SWITCH_CONSTEXPRS), "a fixed switch is still in the source"
    module = _import(tmp_path, step)
    assert callable(getattr(module.optimized_attention_kernel, "__getitem__", None)), "not a Triton kernel"
    assert (render.OUT_DIR / f"{step.file_stem}.py").read_text() == source


def test_the_resolver_keeps_the_branch_taken_with_its_comments():
    src = ("def f(A, B, x):\n"
           "    if A and B:\n"
           "        # both\n"
           "        y = 1\n"
           "    elif x:\n"
           "        y = 2\n"
           "    else:\n"
           "        y = 3\n"
           "    if not A:\n"
           "        z = 4\n"
           "    return y\n")
    assert resolve_branches(src, {"A": True}) == ("def f(A, B, x):\n    if B:\n        # both\n        y = 1\n"
                                                  "    elif x:\n        y = 2\n    else:\n        y = 3\n"
                                                  "    return y\n")
    assert resolve_branches(src, {"A": False}) == ("def f(A, B, x):\n    if x:\n        y = 2\n    else:\n"
                                                   "        y = 3\n    z = 4\n    return y\n")
    module = ("@triton.jit\ndef g(p, q, SW: tl.constexpr):\n    if SW:\n        r = p\n    else:\n        r = p + q\n"
              "    return r\n\n\n@triton.jit\ndef k(P, Q, SW: tl.constexpr):\n    t = Q * 2\n    g(P, t, SW)\n")
    assert resolve_functions(module, ("g", "k"), {"SW": True}) == (
        "@triton.jit\ndef g(p):\n    r = p\n    return r\n\n\n@triton.jit\ndef k(P):\n    g(P)\n")


def _stage_launch(step, q, k, v, o, causal, arch):
    """The stage's one-pass launch (``split_kv=1``: a problem this small would go to decode.py's
    split-KV kernel, which is not the kernel the steps are about)."""
    (one,) = kernels.plan(q, k, v, o, causal=causal, scale=q.shape[-1] ** -0.5, arch=arch, split_kv=1,
                          **step.kwargs)
    return one


@pytest.mark.parametrize("variant, arch", [("+none", 80), ("+causal_skip", 90)])
def test_a_resolved_kernel_computes_what_the_stage_computes(variant, arch, tmp_path):
    """Launch the resolved kernel of the step (with the arguments stage C's plan gives, minus the
    ones it no longer reads) and the stage's own kernel on a tiny ragged causal problem (Nq < Nk,
    keys not a whole number of tiles): the same output to the bit, and within the stage's error
    bound of a float64 reference. +causal_skip is planned for sm_90, so it runs the TMA path
    (the interpreter runs descriptor loads)."""
    step = BY_VARIANT[variant]
    module = _import(tmp_path, step)
    q, k, v = make_qkv(1, 2, 40, 32, torch.float16, "cpu", Nk=72, seed=0)
    outputs = []
    for resolved in (False, True):
        o = torch.full_like(q, float("nan"))
        one = _stage_launch(step, q, k, v, o, True, arch)
        assert {n: one.args[n] for n in SWITCH_CONSTEXPRS} == ladder.switch_values(step)
        assert (one.args["k_desc"] is not None) == (arch == 90), "sm_90 should read through TMA descriptors"
        if resolved:
            kernel = module.optimized_attention_kernel
            params = inspect.signature(kernel.fn).parameters
            kernel[one.grid](**{n: one.args[n] for n in params}, num_warps=one.num_warps, num_stages=one.num_stages)
        else:
            one.run()
        outputs.append(o)
    assert torch.equal(outputs[0], outputs[1])
    check_against_reference(outputs[1], q, k, v, causal=True, dtype_name="fp16")


def test_the_cached_compiled_facts_are_the_compilers():
    """The committed facts are reused while their fingerprints match; compile one step again and
    check that the cache holds what the compiler says."""
    step = BY_VARIANT["+exp2"]
    cached = facts_mod.load_cache(render.OUT_DIR)["steps"][step.variant]["80"]
    assert cached["fingerprint"] == facts_mod.fingerprint(step, 80)
    fresh = facts_mod.compile_facts([(step.variant, 80)])[(step.variant, 80)]
    assert fresh == cached["facts"]


def _csv_ms(variant: str, cell) -> float:
    """The newest ok row's median ms, read from runs.csv directly (not through the generator)."""
    last = None
    with open(render.REPO / "results" / "h200" / "runs.csv", newline="") as f:
        for r in csv.DictReader(f):
            kind, impl = ("stage", "b") if variant == "b" else ("ablation", "c")
            if (r["impl"], r["kind"], r["variant"], r["B"], r["H"], r["N"], r["D"], r["dtype"], r["causal"],
                    r.get("pass") or "fwd", r["status"]) == (impl, kind, "" if variant == "b" else variant,
                                                              str(cell.B), str(cell.H), str(cell.N), str(cell.D),
                                                              "fp16", str(int(cell.causal)), "fwd", "ok") \
                    and (r.get("Hkv") or r["H"]) == r["H"] and (r.get("Nk") or r["N"]) == r["N"] and not r.get("cell"):
                last = float(r["ms_median"])
    return last


def test_the_index_shows_the_speedups_of_the_rows():
    """Spot-check the index against runs.csv read here: +tma over +pipelining, and +none over stage B."""
    index = (render.OUT_DIR / "README.md").read_text()
    tma_row = next(line for line in index.splitlines() if line.startswith("| [03_tma]"))
    none_row = next(line for line in index.splitlines() if line.startswith("| [00_none]"))
    for cell_i, cell in enumerate(CELLS):
        tma = _csv_ms("+pipelining", cell) / _csv_ms("+tma", cell)
        none = _csv_ms("b", cell) / _csv_ms("+none", cell)
        assert tma_row.split(" | ")[2 + cell_i].startswith(f"{tma:.2f}×")
        assert none_row.split(" | ")[2 + cell_i].startswith(f"{none:.2f}×")
