"""Stage C's lean host path (``stages.launch.FastLaunch``): after the first call of a recipe, the
compiled kernel's launcher is called directly, with exactly the arguments ``JITFunction.run``
would pass, and only where Triton would have picked the same compiled kernel.

The CPU tests put a recording stand-in where Triton's ``JITFunction.run`` is: it binds the
arguments with Triton's own binder (what ``run`` does first) and returns a fake compiled kernel
whose launcher records what it receives. GPU-marked tests compare the two paths' outputs and host
times on the real thing."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from stages import launch
from stages.c_optimized import hopper_ws, kernels
from stages.contract import new_output

sys.path.insert(0, str(Path(__file__).parent))
from helpers import check_against_reference, make_qkv  # noqa: E402

#: the per-call host path of one call: (path, arch, attention options, Nq, Nk)
PATHS = {
    "tl-pointers": (80, dict(warp_specialization=False, split_kv=1), 96, 96),
    "tl-tma": (90, dict(warp_specialization=False, split_kv=1), 96, 96),
    "ws": (90, dict(ws_rung=len(hopper_ws.LADDER)), 128, 128),
    "split": (90, dict(split_kv=2), 3, 200),
}


class RecordingJit:
    """Stands in for ``JITFunction.run`` of one kernel: binds the call with Triton's binder (so the
    bound values are exactly those ``run`` would hand to the launcher) and returns a fake compiled
    kernel whose ``run`` (the launcher) records its arguments."""

    def __init__(self, kernel):
        fn = kernel.fn
        jit = kernel if isinstance(kernel, JITFunction) else JITFunction(fn)  # interpreted kernels: the same fn
        self.binder = create_function_from_signature(jit.signature, jit.params, make_backend(GPUTarget("cuda", 90, 32)))
        self.arg_names = jit.arg_names
        self.fn = fn
        self.bound = []      # per ordinary call: (grid, every bound value in parameter order)
        self.launched = []   # per direct launcher call: its positional arguments
        self.compiled = dataclasses.make_dataclass("FakeCompiled", ["run", "function", "packed_metadata"])(
            run=lambda *args: self.launched.append(args), function="function-handle", packed_metadata="packed")

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            bound, _, _ = self.binder(*args, **kwargs)
            self.bound.append((grid, list(bound.values())))
            return self.compiled
        return run


def _recording_recipe(monkeypatch, path: str, causal: bool = False):
    """Stage C's recipe for ``path`` on CPU tensors, its kernels replaced by RecordingJit stand-ins
    and its launches set to take the lean path (the stream: 7, the device: 0)."""
    arch, options, Nq, Nk = PATHS[path]
    q, k, v = make_qkv(1, 4, Nq, 64, torch.float16, "cpu", Hkv=2, Nk=Nk)
    o = new_output(q)
    monkeypatch.setattr(launch, "_driver_getters", lambda: ((lambda: 0), (lambda device: 7)))
    recipe = kernels._recipe_for(q, k, v, o, None, causal, arch, 132, **options)
    launches = []
    for r in recipe.launches:
        r = dataclasses.replace(r, kernel=RecordingJit(r.kernel))
        r.launcher._fast = True  # as on a GPU
        launches.append(r)
    return recipe, launches, kernels._call_tensors(recipe, q, k, v, o, None)


def _same(a, b) -> bool:
    """Equal launch arguments: the same tensor, equal descriptors (a new object per call), else ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if hasattr(a, "block_shape"):
        return type(a) is type(b) and a.__dict__.keys() == b.__dict__.keys() and all(
            _same(a.__dict__[key], b.__dict__[key]) for key in a.__dict__)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("path", sorted(PATHS))
def test_the_lean_launch_passes_what_jit_run_would(monkeypatch, path):
    recipe, launches, tensors = _recording_recipe(monkeypatch, path)
    expected_kernels = {"tl-pointers": 1, "tl-tma": 1, "ws": 1, "split": 2}[path]
    assert recipe.choice.path == path.split("-")[0] and len(launches) == expected_kernels
    for r in launches:
        jit = r.kernel
        r.launch(tensors, 0.125)    # first call: Triton's ordinary path, which returns the compiled kernel
        r.launch(tensors, 0.125)    # second: straight to the launcher
        assert len(jit.bound) == 1 and len(jit.launched) == 1
        grid, bound = jit.bound[0]
        head, args = jit.launched[0][:9], jit.launched[0][9:]
        g = tuple(grid) + (1, 1)
        assert head == (g[0], g[1], g[2], 7, "function-handle", "packed", None, None, None)
        assert len(args) == len(jit.arg_names) == len(bound)  # every parameter, constexprs included
        mismatched = [name for name, a, b in zip(jit.arg_names, args, bound) if not _same(a, b)]
        assert not mismatched, f"{path}: arguments differ from JITFunction.run's: {mismatched}"
        if r.descs:  # the descriptors carry this call's tensors
            assert any(getattr(a, "base", None) is tensors["q"] for a in args)


def test_a_new_pointer_alignment_goes_back_to_triton(monkeypatch):
    """Triton compiles a kernel per pointer alignment (16-byte or not): a misaligned tensor must not
    reuse the kernel compiled for aligned ones, and an aligned one must find its kernel again."""
    recipe, (r,), tensors = _recording_recipe(monkeypatch, "tl-pointers")
    jit = r.kernel
    buffer = torch.zeros(tensors["q"].numel() + 8, dtype=torch.float16)
    shifted = buffer[1:1 + tensors["q"].numel()].view(tensors["q"].shape)  # 2 bytes past a 16-byte boundary
    assert shifted.data_ptr() % 16 and shifted.stride() == tensors["q"].stride()
    r.launch(tensors, 0.1)
    r.launch({**tensors, "q": shifted}, 0.1)
    assert (len(jit.bound), len(jit.launched)) == (2, 0)
    r.launch(tensors, 0.1)
    r.launch({**tensors, "q": shifted}, 0.1)
    assert (len(jit.bound), len(jit.launched)) == (2, 2)
    assert jit.launched[1][9:][0] is shifted


def test_the_recipe_key_holds_alignment_and_strides():
    q, k, v = make_qkv(1, 4, 64, 64, torch.float16, "cpu")
    o = new_output(q)
    buffer = torch.zeros(q.numel() + 8, dtype=torch.float16)
    shifted = buffer[1:1 + q.numel()].view(q.shape)
    strided = make_qkv(1, 4, 64, 64, torch.float16, "cpu", layout="bnhd")[0]
    assert strided.stride() != q.stride()
    recipe = kernels._recipe_for(q, k, v, o, None, False, 90, 132)
    assert kernels._recipe_for(q, k, v, o, None, False, 90, 132) is recipe
    misaligned = kernels._recipe_for(shifted, k, v, o, None, False, 90, 132)
    restrided = kernels._recipe_for(strided, k, v, o, None, False, 90, 132)
    assert misaligned is not recipe and restrided is not recipe and misaligned is not restrided
    # TMA needs 16-byte aligned bases: the misaligned recipe reads through pointers.
    assert recipe.launches[0].descs and not misaligned.launches[0].descs


@pytest.mark.parametrize("how", ["enter hook", "exit hook", "debug", "switched off"])
def test_hooks_debug_and_the_switch_force_the_ordinary_path(monkeypatch, how):
    recipe, (r,), tensors = _recording_recipe(monkeypatch, "tl-tma")
    jit = r.kernel
    r.launch(tensors, 0.1)  # compiled and kept
    hook = lambda metadata: None  # noqa: E731
    if how == "enter hook":
        knobs.runtime.launch_enter_hook.add(hook)
    elif how == "exit hook":
        monkeypatch.setattr(knobs.runtime, "launch_exit_hook", hook)  # assigned, not added: also seen
    elif how == "debug":
        monkeypatch.setattr(knobs.runtime, "debug", True)
    else:
        monkeypatch.setattr(launch, "fast_launch_enabled", False)
    try:
        assert launch.launch_hooks_active() == (how != "switched off")
        r.launch(tensors, 0.1)
        r.launch(tensors, 0.1)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert (len(jit.bound), len(jit.launched)) == (3, 0)
    monkeypatch.undo()
    monkeypatch.setattr(launch, "_driver_getters", lambda: ((lambda: 0), (lambda device: 7)))
    assert not launch.launch_hooks_active()
    r.launch(tensors, 0.1)
    assert (len(jit.bound), len(jit.launched)) == (3, 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on a machine without a GPU")
def test_the_interpreter_never_takes_the_lean_path():
    q, k, v = make_qkv(1, 2, 40, 16, torch.float32, "cpu")
    o = kernels.attention(q, k, v, causal=True)
    check_against_reference(o, q, k, v, causal=True, dtype_name="fp32")
    recipe = kernels._recipe_for(q, k, v, new_output(q), None, True, 80, kernels._arch_and_sms(q)[1])
    assert all(not r.launcher._compiled for r in recipe.launches)


def test_a_launch_must_name_every_parameter_once():
    kernel = kernels.decode.merge_splits_kernel
    names = list(kernel.arg_names)
    with pytest.raises(ValueError, match="each parameter"):
        launch.FastLaunch(kernel, (1,), {n: 1 for n in names[1:]}, (), pointers=0)
    with pytest.raises(ValueError, match="each parameter"):
        launch.FastLaunch(kernel, (1,), {n: 1 for n in names}, (names[0],), pointers=1)
    fl = launch.FastLaunch(kernel, (1,), {n: i for i, n in enumerate(names[1:])}, (names[0],), pointers=1)
    assert fl.arguments("x") == ["x", *range(len(names) - 1)]


# ----------------------------------------------------------------------------------------------- GPU

GPU_CASES = {
    "tl": (dict(warp_specialization=False, split_kv=1), 2, 4, 2, 200, 200, True),
    "split": (dict(split_kv=3), 2, 8, 2, 1, 700, False),
    "ws": (dict(ws_rung=len(hopper_ws.LADDER)), 2, 4, 4, 512, 512, True),
}


def _counting(monkeypatch, recipe) -> list:
    """Count the calls of Triton's ordinary path (``JITFunction.run``) of the recipe's kernels."""
    calls = []
    for r in recipe.launches:
        original = r.kernel.run
        monkeypatch.setattr(r.kernel, "run", lambda *a, _o=original, **kw: calls.append(1) or _o(*a, **kw))
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("path", sorted(GPU_CASES))
def test_gpu_lean_path_matches_the_ordinary_path(monkeypatch, path):
    options, B, Hq, Hkv, Nq, Nk, causal = GPU_CASES[path]
    q, k, v = make_qkv(B, Hq, Nq, 64, torch.float16, "cuda", Hkv=Hkv, Nk=Nk)
    if path == "ws" and kernels._arch_and_sms(q)[0] != 90:
        pytest.skip("the warp-specialized kernel needs sm_90")
    monkeypatch.setattr(launch, "fast_launch_enabled", False)
    ordinary = kernels.attention(q, k, v, causal=causal, **options)
    monkeypatch.setattr(launch, "fast_launch_enabled", True)
    recipe = kernels._recipe_for(q, k, v, ordinary, None, causal, *kernels._arch_and_sms(q),
                                 **{**dict(config=None, split_kv=None, ws_rung=None), **options})
    assert recipe.choice.path == path
    kernels.attention(q, k, v, causal=causal, **options)  # keeps the compiled kernels
    calls = _counting(monkeypatch, recipe)
    for _ in range(3):
        q.normal_()  # new data, same tensors: the lean path must read it
        lean = kernels.attention(q, k, v, causal=causal, **options)
        assert not calls, "the lean path went through JITFunction.run"
        monkeypatch.setattr(launch, "fast_launch_enabled", False)
        ordinary_now = kernels.attention(q, k, v, causal=causal, **options)
        monkeypatch.setattr(launch, "fast_launch_enabled", True)
        calls.clear()
        assert torch.equal(lean, ordinary_now)
        check_against_reference(lean, q, k, v, causal=causal, dtype_name="fp16")


@pytest.mark.gpu
def test_gpu_misaligned_view_after_aligned_calls_is_right():
    q, k, v = make_qkv(1, 4, 96, 64, torch.float16, "cuda")
    kernels.attention(q, k, v)
    kernels.attention(q, k, v)  # the aligned kernel is kept
    buffer = torch.empty(q.numel() + 8, dtype=q.dtype, device=q.device)
    shifted = buffer[4:4 + q.numel()].view(q.shape).copy_(q)  # 8 bytes past a 16-byte boundary
    for _ in range(2):
        check_against_reference(kernels.attention(shifted, k, v), shifted, k, v, causal=False, dtype_name="fp16")


@pytest.mark.gpu
def test_gpu_lean_path_costs_less_host_time(monkeypatch):
    """Benchmark-like: only "strictly fewer µs per call than Triton's ordinary path", no number."""
    from harness.latency import host_us_per_call

    q, k, v = make_qkv(1, 8, 128, 64, torch.float16, "cuda")
    call = lambda: kernels.attention(q, k, v)  # noqa: E731
    monkeypatch.setattr(launch, "fast_launch_enabled", False)
    ordinary = min(host_us_per_call(call, 300, torch.cuda.synchronize) for _ in range(3))
    monkeypatch.setattr(launch, "fast_launch_enabled", True)
    lean = min(host_us_per_call(call, 300, torch.cuda.synchronize) for _ in range(3))
    assert lean < ordinary, f"lean {lean:.1f} µs per call, ordinary {ordinary:.1f}"
