"""Stage C's lean host path (``stages.launch.FastLaunch``): after the first call of a kernel key, the
compiled kernel's launcher is called directly, with exactly the arguments ``JITFunction.run``
would pass, and only where Triton would have picked the same compiled kernel. And the key is what
changes the kernel, never the sizes: a decode loop whose KV cache grows by one key per call
compiles nothing new after its first calls.

The CPU tests put a recording stand-in where Triton's ``JITFunction.run`` is: it binds the
arguments with Triton's own binder (what ``run`` does first: its specialization list is what
Triton keys compiled kernels on) and returns a fake compiled kernel whose launcher records what it
receives. GPU-marked tests compare the two paths' outputs and host times on the real thing."""

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

import stages
from stages import launch
from stages.c_optimized import decode, hopper_ws, kernels
from stages.c_optimized.configs import SHARED_MEMORY_LIMIT
from stages.contract import new_output

sys.path.insert(0, str(Path(__file__).parent))
from helpers import check_against_reference, check_gradients, make_qkv  # noqa: E402

#: the per-call host path of one call: (path, arch, attention options, Nq, Nk)
PATHS = {
    "tl-pointers": (80, dict(warp_specialization=False, split_kv=1), 96, 96),
    "tl-tma": (90, dict(warp_specialization=False, split_kv=1), 96, 96),
    "ws": (90, dict(ws_rung=len(hopper_ws.LADDER)), 128, 128),
    "split": (90, dict(split_kv=2), 3, 200),
}


def _jit_function(kernel) -> JITFunction:
    """The compiling JITFunction of a kernel (an interpreted kernel: one built from the same function,
    with the same ``do_not_specialize`` list)."""
    if isinstance(kernel, JITFunction):
        return kernel
    return JITFunction(kernel.fn, **{k: v for k, v in kernel.kwargs.items() if k.startswith("do_not_specialize")})


class RecordingJit:
    """Stands in for ``JITFunction.run`` of one kernel: binds the call with Triton's binder (so the
    bound values are exactly those ``run`` would hand to the launcher, and the specialization is
    what Triton would key the compiled kernel on) and returns a fake compiled kernel whose ``run``
    (the launcher) records its arguments."""

    def __init__(self, kernel):
        jit = _jit_function(kernel)
        self.binder = create_function_from_signature(jit.signature, jit.params, make_backend(GPUTarget("cuda", 90, 32)))
        self.arg_names = jit.arg_names
        self.params = jit.params
        self.fn = jit.fn
        self.bound = []            # per ordinary call: (grid, every bound value in parameter order)
        self.specializations = []  # per ordinary call: Triton's specialization of the arguments
        self.launched = []         # per direct launcher call: its positional arguments
        self.compiled = dataclasses.make_dataclass("FakeCompiled", ["run", "function", "packed_metadata"])(
            run=lambda *args: self.launched.append(args), function="function-handle", packed_metadata="packed")

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            bound, specialization, _ = self.binder(*args, **kwargs)
            self.bound.append((grid, list(bound.values())))
            self.specializations.append(tuple(specialization))
            return self.compiled
        return run

    def warmup(self, *args, grid, **kwargs):
        """Triton compiles without launching: a specialization, no launch."""
        _, specialization, _ = self.binder(*args, **kwargs)
        self.specializations.append(tuple(specialization))
        return self.compiled


def _recording(monkeypatch, recipe):
    """The recipe with its kernels replaced by RecordingJit stand-ins and its launches set to take the
    lean path (the stream: 7, the device: 0)."""
    monkeypatch.setattr(launch, "_driver_getters", lambda: ((lambda: 0), (lambda device: 7)))
    launches = []
    for r in recipe.launches:
        r = dataclasses.replace(r, kernel=RecordingJit(r.kernel))
        r.launcher._fast = True  # as on a GPU
        launches.append(r)
    return dataclasses.replace(recipe, launches=tuple(launches))


def _call(recipe, choice, q, k, v, o, scale=0.125, tensors=None):
    """One call's launches, as stage C's forward makes them (``tensors``: the call's, workspace
    included; by default allocated here)."""
    workspace, runs = recipe.runtime(q, k, v, o, choice)
    if tensors is None:
        tensors = kernels._call_tensors(workspace, q, k, v, o, None)
    for r, (grid, ints) in zip(recipe.launches, runs):
        r.launch(grid, tensors, ints, scale)
    if len(runs) < len(recipe.launches):
        kernels._prepare_merge(recipe, runs, tensors, scale)
    return tensors, runs


def _recording_recipe(monkeypatch, path: str, causal: bool = False):
    arch, options, Nq, Nk = PATHS[path]
    q, k, v = make_qkv(1, 4, Nq, 64, torch.float16, "cpu", Hkv=2, Nk=Nk)
    o = new_output(q)
    choice, recipe = kernels._plan_call(q, k, v, o, None, causal, arch, 132, **options)
    return choice, _recording(monkeypatch, recipe), (q, k, v, o)


def _same(a, b) -> bool:
    """Equal launch arguments: the tensor's address where JITFunction.run binds a tensor (the lean
    path hands the launcher addresses), equal descriptors (a new object per call), else ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):  # (a descriptor's base: the tensor itself)
        return a is b or (type(a) is int and isinstance(b, torch.Tensor) and a == b.data_ptr())
    if hasattr(a, "block_shape"):
        return type(a) is type(b) and a.__dict__.keys() == b.__dict__.keys() and all(
            _same(a.__dict__[key], b.__dict__[key]) for key in a.__dict__)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("path", sorted(PATHS))
def test_the_lean_launch_passes_what_jit_run_would(monkeypatch, path):
    choice, recipe, (q, k, v, o) = _recording_recipe(monkeypatch, path)
    expected_kernels = {"tl-pointers": 1, "tl-tma": 1, "ws": 1, "split": 2}[path]
    assert choice.path == recipe.path == path.split("-")[0] and len(recipe.launches) == expected_kernels
    tensors, _ = _call(recipe, choice, q, k, v, o)  # first call: Triton's ordinary path, returning the kernel
    tensors, runs = _call(recipe, choice, q, k, v, o, tensors=tensors)  # second: straight to the launcher
    for r, (grid, _) in zip(recipe.launches, runs):
        jit = r.kernel
        assert len(jit.bound) == 1 and len(jit.launched) == 1
        bound_grid, bound = jit.bound[0]
        assert tuple(bound_grid) == tuple(grid)
        head, args = jit.launched[0][:9], jit.launched[0][9:]
        g = tuple(grid) + (1, 1)
        assert head == (g[0], g[1], g[2], 7, "function-handle", "packed", None, None, None)
        assert len(args) == len(jit.arg_names) == len(bound)  # every parameter, constexprs included
        mismatched = [name for name, a, b in zip(jit.arg_names, args, bound) if not _same(a, b)]
        assert not mismatched, f"{path}: arguments differ from JITFunction.run's: {mismatched}"
        if r.descs:  # the descriptors carry this call's tensors and shapes
            desc = next(a for a in args if getattr(a, "base", None) is tensors["q"])
            assert desc.shape == list(q.shape) and desc.strides == list(q.stride())


def _forward_through(monkeypatch, path: str):
    """Stage C's forward (``kernels._forward``) for ``path``'s problem, planned for its GPU, with the
    recipe's kernels recording (``_recording``): returns (call(q, k, v, scale) -> o, recipe, (q, k, v))."""
    arch, options, Nq, Nk = PATHS[path]
    q, k, v = make_qkv(1, 4, Nq, 64, torch.float16, "cpu", Hkv=2, Nk=Nk)
    choice, recipe = kernels._plan_call(q, k, v, new_output(q), None, False, arch, 132, **options)
    recipe = _recording(monkeypatch, recipe)
    monkeypatch.setattr(kernels, "_plan_call", lambda *a, **kw: (choice, recipe))
    monkeypatch.setattr(kernels, "_arch_and_sms", lambda t: (arch, 132))
    monkeypatch.setattr(kernels, "_LAYOUT_PLANS", {})
    defaults = dict(config=None, split_kv=None, ws_rung=None, **dict.fromkeys(kernels.SWITCH_NAMES, True))
    opts = {**defaults, **options}

    def call(q, k, v, scale=0.125):
        return kernels._forward(q, k, v, False, scale, False, opts["config"], opts["split_kv"], opts["ws_rung"],
                                *(opts[name] for name in kernels.SWITCH_NAMES), False)[0]
    return call, recipe, (q, k, v)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_layout_s_bound_launches_pass_what_the_lean_launch_would(monkeypatch, path):
    """After a layout's first call its launches are bound once (``launch.BoundLaunch``): later calls of
    the layout hand over addresses and the scale only. What reaches the launcher is what the lean launch
    (itself checked against ``JITFunction.run`` above) passes for the same tensors and scale: every
    argument, new tensors' addresses, a new scale, descriptors over this call's tensors."""
    call, recipe, (q, k, v) = _forward_through(monkeypatch, path)
    call(q, k, v)  # Triton's ordinary path: compiles (here, records) and keeps the kernels
    (planned,) = kernels._LAYOUT_PLANS.values()
    assert isinstance(planned.bound, kernels._BoundLayout)
    q2, k2, v2 = (t.clone() for t in (q, k, v))  # new tensors of the same layout
    o_bound = call(q2, k2, v2, scale=0.3)
    bound_args = [r.kernel.launched[-1] for r in recipe.launches[:len(planned.runs)]]
    planned.bound = False  # the same call without the binding: the lean launch of each kernel
    call(q2, k2, v2, scale=0.3)
    lean_args = [r.kernel.launched[-1] for r in recipe.launches[:len(planned.runs)]]
    assert all(len(r.kernel.bound) == 1 for r in recipe.launches[:len(planned.runs)])  # (the first call's)
    # A fresh output and fp32 workspace per call: their addresses differ between the two calls.
    fresh = {"o"} | {role for role, shape in planned.workspace if shape is not None}
    this_call = {"q": q2, "k": k2, "v": v2, "o": o_bound}
    descs = {name: role for name, role, *_ in recipe.launches[0].descs}
    for r, got, want in zip(recipe.launches, bound_args, lean_args):
        assert len(got) == len(want)
        names = [None] * 9 + list(r.kernel.arg_names)
        roles = dict(r.tensors)
        for name, a, b in zip(names, got, want):
            role = roles.get(name)
            if role in this_call:  # this call's tensors, by address
                assert a == this_call[role].data_ptr(), f"{path}: {name} is not the {role} of this call"
            elif role in fresh:
                assert type(a) is int and a % 16 == 0
            elif name in descs:  # a descriptor over this call's tensor of its role, otherwise the same
                assert a.base is this_call[descs[name]] and a.block_shape == b.block_shape
                assert a.shape == b.shape and a.strides == b.strides
            else:
                assert _same(a, b), f"{path}: {name} differs: {a!r} against {b!r}"
        if r.scale_factor is not None:
            assert 0.3 * r.scale_factor in got


def test_a_bound_launch_keeps_none_of_the_binding_call_s_tensors():
    """A bound launch keeps every argument of the call that bound it but its pointers and per-call
    values: those slots are written by each call, and the binding call's tensors (its output, its
    gradients, a descriptor's tensor) must not be held for as long as the layout is known (inside a
    CUDA-graph pool PyTorch refuses memory that outlives the graph's outputs). Each launch still
    passes its own addresses and values with the kept ones."""
    import gc
    import types
    import weakref

    t, desc = torch.empty(4), types.SimpleNamespace(base=torch.empty(2))
    refs = [weakref.ref(t), weakref.ref(desc.base)]
    launched = []
    entry = (lambda *args: launched.append(args), "function", ("before",), None)
    bound = launch.BoundLaunch(entry, (3,), [t, 5, desc, 0.5], (0,), (2, 3), 0, lambda: 0, lambda device: 7)
    del t, desc
    gc.collect()
    assert all(r() is None for r in refs), "the bound launch still holds the binding call's tensors"
    bound.launch([1234], ["this call's descriptor", 0.25])
    assert launched == [(3, 1, 1, 7, "function", "before", 1234, 5, "this call's descriptor", 0.25)]


@pytest.mark.parametrize("how", ["enter hook", "switched off", "other device"])
def test_bound_launches_step_aside_for_hooks_the_switch_and_another_device(monkeypatch, how):
    """A bound layout launches only while the lean path would: with a launch hook, the switch off or
    another device current than the one it was bound on, the call takes the full path instead
    (Triton's ordinary one for the first two, the lean launch, which keys its kernels on the device,
    for the other)."""
    call, recipe, (q, k, v) = _forward_through(monkeypatch, "tl-tma")
    jit = recipe.launches[0].kernel
    call(q, k, v)
    (planned,) = kernels._LAYOUT_PLANS.values()
    bound = planned.bound.launches[0][0]
    assert bound.open()
    hook = lambda metadata: None  # noqa: E731
    if how == "enter hook":
        knobs.runtime.launch_enter_hook.add(hook)
    elif how == "switched off":
        monkeypatch.setattr(launch, "fast_launch_enabled", False)
    else:
        monkeypatch.setattr(bound, "_get_device", lambda: 1)
    try:
        assert not bound.open()
        call(q, k, v)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    if how == "other device":  # (only the bound launch was told: the lean launch saw device 0 still)
        assert (len(jit.bound), len(jit.launched)) == (1, 1)
    else:
        assert (len(jit.bound), len(jit.launched)) == (2, 0)


def test_a_kernel_without_scratch_goes_to_the_c_launcher_itself():
    """What FastLaunch keeps of a compiled kernel: Triton 3.6's C launcher with the arguments its
    Python wrapper (``CudaLauncher``) would add, when the kernel asks for no scratch buffer and takes
    no TMA descriptor the wrapper must unpack; the wrapper otherwise."""
    calls = []

    def c_launch(*args):
        calls.append(args)

    c_launch.__name__ = "launch"  # the C launcher's name in Triton's generated module
    run = type("CudaLauncher", (), {})()
    run.launch, run.launch_cooperative_grid, run.launch_pdl = c_launch, False, True
    run.global_scratch_size = run.profile_scratch_size = 0
    compiled = dataclasses.make_dataclass("Compiled", ["run", "function", "packed_metadata"])(run, 11, "packed")
    fn, function, before, descriptors = launch._kept(compiled)
    assert fn is c_launch and function == 11 and descriptors is None
    fn(1, 2, 3, "stream", function, *before, "arg0")
    assert calls == [(1, 2, 3, "stream", 11, False, True, None, None, "packed", None, None, None, "arg0")]
    for scratch in ("global_scratch_size", "profile_scratch_size"):
        setattr(run, scratch, 128)
        assert launch._kept(compiled) == (run, 11, ("packed", None, None, None), None)
        setattr(run, scratch, 0)
    del run.launch_pdl  # a launcher of another shape than Triton 3.6's: kept whole
    assert launch._kept(compiled)[0] is run
    run.launch_pdl = True
    run.launch = lambda *args: None  # an unpacking wrapper of another shape: kept whole, nothing reached through it
    assert launch._kept(compiled)[0] is run and launch._kept(compiled)[3] is None


def _descriptor_kernel(monkeypatch, maps: bool = True):
    """A compiled kernel taking (pointer, descriptor, int, constexpr, descriptor, float) whose launcher is
    Triton 3.6's own wrapper (``wrap_handle_tensordesc``) around a recording C launcher. ``maps``: the
    descriptors lowered to host-made tensor maps (metadata per descriptor, as for Gluon kernels), with
    Triton's ``make_tensordesc_arg`` replaced by one that needs no GPU and counts the maps it makes;
    otherwise no metadata (the kernel makes its descriptors on the GPU, as ``tl`` kernels here do)."""
    from triton.backends.nvidia import driver as nvidia_driver

    made, c_calls = [], []
    triton_s_own = nvidia_driver.make_tensordesc_arg

    def make_tensordesc_arg(desc, meta):  # [tensor map, *shape, *strides], as Triton's makes it
        if meta is None:
            return triton_s_own(desc, meta)
        made.append(desc.base.data_ptr())
        return [("map", desc.base.data_ptr(), tuple(desc.block_shape), meta["swizzle"]), *desc.shape, *desc.strides]

    monkeypatch.setattr(nvidia_driver, "make_tensordesc_arg", make_tensordesc_arg)
    signature = {0: "*fp16", 1: "tensordesc<fp16[64, 64]>", 2: "i32", 3: "constexpr", 4: "tensordesc<fp16[32, 64]>",
                 5: "fp32"}
    metas = [{"swizzle": 128}, {"swizzle": 64}] if maps else None
    run = type("CudaLauncher", (), {})()
    run.launch = nvidia_driver.wrap_handle_tensordesc(lambda *args: c_calls.append(args), signature, metas)
    run.launch_cooperative_grid, run.launch_pdl = False, False
    run.global_scratch_size = run.profile_scratch_size = 0
    compiled = dataclasses.make_dataclass("Compiled", ["run", "function", "packed_metadata"])(run, 11, "packed")
    return compiled, made, c_calls


def _addresses(args: tuple) -> tuple:
    """Launcher arguments with each tensor as its address: what the C launcher reads off either."""
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("maps", [True, False], ids=["tensor maps", "made on the GPU"])
def test_a_bound_descriptor_launch_hands_the_c_launcher_what_triton_s_wrapper_would(monkeypatch, maps):
    """A kernel with TMA descriptors keeps Triton's wrapper, which flattens every descriptor on every
    call (making its tensor map, or handing over its base tensor for the kernel to build one from);
    bound, its launch goes to the C launcher itself with the same flattened arguments (a base as its
    address) and makes a map only for a base address it has not seen."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    compiled, made, c_calls = _descriptor_kernel(monkeypatch, maps)
    entry = launch._kept(compiled)
    assert entry[0] is compiled.run and entry[3] is not None  # the wrapper kept, the C launcher reachable

    def desc(t, block):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block)

    a, b, c = (torch.randn(2, 64, 64, dtype=torch.float16) for _ in range(3))
    pointer = torch.empty(8, dtype=torch.float16)
    bound = launch.BoundLaunch(entry, (5, 2), [pointer, desc(a, [1, 64, 64]), 7, 3, desc(b, [1, 32, 64]), 0.5],
                               (0,), (1, 4, 5), 0, lambda: 0, lambda device: "stream")
    assert bound._raw is not None
    made.clear()  # (the binding made its own descriptors' maps)

    def triton_s(address, x, y, scale):  # what Triton's path hands the C launcher for these values
        entry[0].launch(5, 2, 1, "stream", 11, False, False, None, None, "packed", None, None, None,
                        address, desc(x, [1, 64, 64]), 7, 3, desc(y, [1, 32, 64]), scale)
        return c_calls.pop()

    for x, y, new_maps in ((a, b, []), (c, a, [c.data_ptr(), a.data_ptr()]), (c, a, []), (a, b, [])):
        bound.launch([1234], [x, y, 0.25])
        got = c_calls.pop()
        assert made == (new_maps if maps else []), "a tensor map made again for an address the bound launch has seen"
        made.clear()
        assert not any(isinstance(g, torch.Tensor) for g in got)  # (addresses: no driver query per call)
        assert got == _addresses(triton_s(1234, x, y, 0.25))
        made.clear()
    if maps:  # a full table starts again rather than growing with every address a long run brings
        monkeypatch.setattr(launch, "TENSOR_MAPS_KEPT", 2)
        for t in (torch.randn(2, 64, 64, dtype=torch.float16) for _ in range(3)):
            bound.launch([1234], [t, b, 0.25])
        assert len(bound._raw._maps[0]) <= 2


def test_a_bound_descriptor_launch_keeps_no_tensor_and_steps_aside_where_triton_differs(monkeypatch):
    """The kept maps are keyed by addresses and hold no tensor of the binding call; a wrapper that is
    not Triton 3.6's closure keeps the wrapper whole."""
    import gc
    import weakref

    from triton.tools.tensor_descriptor import TensorDescriptor

    compiled, made, _ = _descriptor_kernel(monkeypatch)
    t = torch.randn(2, 64, 64, dtype=torch.float16)
    ref = weakref.ref(t)
    d1, d2 = (TensorDescriptor(t, list(t.shape), list(t.stride()), block) for block in ([1, 64, 64], [1, 32, 64]))
    bound = launch.BoundLaunch(launch._kept(compiled), (1,), [torch.empty(2), d1, 7, 3, d2, 0.5], (0,), (1, 4, 5),
                               0, lambda: 0, lambda device: None)
    assert bound._raw is not None
    del t, d1, d2
    gc.collect()
    assert ref() is None, "the bound launch still holds the binding call's tensor"
    compiled.run.launch = lambda *args: None
    assert launch._kept(compiled)[3] is None


def test_a_new_pointer_alignment_goes_back_to_triton(monkeypatch):
    """Triton compiles a kernel per pointer alignment (16-byte or not): a misaligned tensor must not
    reuse the kernel compiled for aligned ones, and an aligned one must find its kernel again."""
    choice, recipe, (q, k, v, o) = _recording_recipe(monkeypatch, "tl-pointers")
    jit = recipe.launches[0].kernel
    buffer = torch.zeros(q.numel() + 8, dtype=torch.float16)
    shifted = buffer[1:1 + q.numel()].view(q.shape)  # 2 bytes past a 16-byte boundary
    assert shifted.data_ptr() % 16 and shifted.stride() == q.stride()
    _call(recipe, choice, q, k, v, o)
    _call(recipe, choice, shifted, k, v, o)
    assert (len(jit.bound), len(jit.launched)) == (2, 0)
    _call(recipe, choice, q, k, v, o)
    _call(recipe, choice, shifted, k, v, o)
    assert (len(jit.bound), len(jit.launched)) == (2, 2)
    assert jit.launched[1][9:][0] == shifted.data_ptr()


def test_a_stride_that_specializes_differently_goes_back_to_triton(monkeypatch):
    """Strides keep Triton's divisibility-by-16 specialization: a layout whose strides change that
    fact must not reuse the other layout's kernel."""
    choice, recipe, (q, k, v, o) = _recording_recipe(monkeypatch, "tl-pointers")
    jit = recipe.launches[0].kernel
    padded = torch.zeros(q.shape[0], q.shape[1], q.shape[2], 72, dtype=q.dtype)[..., :64]  # row stride 72
    padded.copy_(q)
    _call(recipe, choice, q, k, v, o)
    _call(recipe, choice, padded, k, v, o)
    _call(recipe, choice, padded, k, v, o)
    assert (len(jit.bound), len(jit.launched)) == (2, 1)
    assert jit.specializations[0] != jit.specializations[1]


def test_an_integer_past_32_bits_takes_triton_s_own_path(monkeypatch):
    choice, recipe, (q, k, v, o) = _recording_recipe(monkeypatch, "tl-pointers")
    r = recipe.launches[0]
    workspace, ((grid, ints),) = recipe.runtime(q, k, v, o, choice)
    tensors = kernels._call_tensors(workspace, q, k, v, o, None)
    wide = (2 ** 33,) + ints[1:]
    for _ in range(2):
        r.launch(grid, tensors, wide, 0.1)
    assert (len(r.kernel.bound), len(r.kernel.launched)) == (2, 0)


def test_the_recipe_key_holds_alignment_and_strides_not_sizes():
    q, k, v = make_qkv(1, 4, 96, 64, torch.float16, "cpu")
    o = new_output(q)
    buffer = torch.zeros(q.numel() + 8, dtype=torch.float16)
    shifted = buffer[1:1 + q.numel()].view(q.shape)
    choice, recipe = kernels._plan_call(q, k, v, o, None, False, 90, 132)
    assert kernels._plan_call(q, k, v, o, None, False, 90, 132)[1] is recipe
    # TMA needs 16-byte aligned bases: the misaligned call reads through pointers, another kernel.
    misaligned = kernels._plan_call(shifted, k, v, o, None, False, 90, 132)[1]
    assert misaligned is not recipe
    assert recipe.launches[0].descs and not misaligned.launches[0].descs
    # Other sizes and another layout of the same problem: the same kernel key, the same recipe.
    q2, k2, v2 = make_qkv(3, 4, 50, 64, torch.float16, "cpu", Nk=77, layout="bnhd")
    assert kernels._plan_call(q2, k2, v2, new_output(q2), None, False, 90, 132, split_kv=1)[1] is recipe


def test_a_call_whose_programs_walk_one_key_tile_reads_by_pointers():
    """On sm_90 the ``tl`` kernel reads by TMA, except where every program walks a single K/V tile
    (``kernels.one_key_tile``: Nk up to the config's BLOCK_N), which has nothing to pipeline and pays for
    the descriptors: there the call takes the pointer kernel, one more recipe for the layout, the same
    for every such Nk, and every longer Nk is back on the TMA recipe."""
    recipes = {}
    for nk in (1, 40, 64, 65, 300):
        q, k, v = make_qkv(1, 4, 64, 64, torch.float16, "cpu", Nk=nk)
        choice, recipe = kernels._plan_call(q, k, v, new_output(q), None, False, 90, 132, split_kv=1)
        assert choice.path == "tl" and choice.config.block_n == 64, choice
        assert kernels.one_key_tile(choice, nk) == (nk <= 64)
        assert bool(recipe.launches[0].descs) == (nk > 64), nk
        recipes.setdefault(nk <= 64, set()).add(id(recipe))
    assert all(len(ids) == 1 for ids in recipes.values()), recipes
    q, k, v = make_qkv(1, 4, 64, 64, torch.float16, "cpu")
    for arch in (80, 90):  # sm_80 reads by pointers anyway; the switch off, too
        choice, recipe = kernels._plan_call(q, k, v, new_output(q), None, False, arch, 132, split_kv=1, tma=False)
        assert not recipe.launches[0].descs


def _decode_loop(path_options: dict, D: int, Hq: int, Hkv: int, nks: range, arch: int = 90, causal=True):
    """Stage C's host path for a growing KV cache: q [2, Hq, 1, D] against k, v [2, Hkv, Nk, D], one
    call per Nk, the cache a fresh contiguous tensor each time (as a concatenating cache gives it)."""
    calls = []
    for nk in nks:
        q, k, v = make_qkv(2, Hq, 1, D, torch.float16, "cpu", Hkv=Hkv, Nk=nk)
        o = new_output(q)
        calls.append(((q, k, v, o), kernels._plan_call(q, k, v, o, None, causal, arch, 132, **path_options)))
    return calls


@pytest.mark.parametrize("D", [64, 24])  # 24: the cache's head stride (Nk·D) flips its divisibility by 16
@pytest.mark.parametrize("Hq,Hkv,options", [(12, 12, {}), (16, 4, {}), (8, 8, dict(split_kv=1))],
                         ids=["mha", "gqa", "mha-unsplit"])
def test_a_growing_kv_cache_compiles_nothing_new(monkeypatch, D, Hq, Hkv, options):
    """A decode loop of 64 calls around the cache length where a split of the keys starts to pay (the
    split count changes within the loop): one recipe for every call, and the specializations that
    Triton would compile a kernel for stop growing after the first two calls (at most two values of
    the cache's head-stride divisibility; the sizes and the split count are runtime values)."""
    # A second chunk needs 2 * MIN_TILES_PER_SPLIT tiles of the plan's width (sm_90, fp16)
    block_n = decode.decode_tiles(Hq // Hkv, 1, D, 2, SHARED_MEMORY_LIMIT[90]).block_n
    first_split = (2 * decode.MIN_TILES_PER_SPLIT - 1) * block_n + 1
    calls = _decode_loop(options, D, Hq, Hkv, range(first_split - 30, first_split + 34))
    split_counts = {recipe.runtime(*tensors, choice)[1][0][0][0] for tensors, (choice, recipe) in calls
                    if choice.path == "split"}
    assert len(split_counts) == (0 if options else 2), split_counts  # one chunk, then two, in one loop
    recipes = {id(recipe) for _, (_, recipe) in calls}
    assert len(recipes) == 1
    recipe = _recording(monkeypatch, calls[0][1][1])
    seen_after = []
    for (q, k, v, o), (choice, _) in calls:
        _call(recipe, choice, q, k, v, o)
        seen_after.append(tuple(len(set(r.kernel.specializations)) for r in recipe.launches))
    assert seen_after[-1] == seen_after[1], f"new specializations after the second call: {seen_after}"
    assert all(n <= 2 for n in seen_after[-1])
    # ... and after those, every launch went to the compiled kernel's launcher directly (a merge
    # that the short first calls did not need was compiled at the first call, not launched).
    assert all(len(r.kernel.bound) <= 2 for r in recipe.launches), [len(r.kernel.bound) for r in recipe.launches]


def test_the_sizes_reach_the_kernels_unspecialized():
    """Every size argument of stage C's kernels is ``do_not_specialize``: Triton would otherwise make
    a size equal to 1 a constexpr and key kernels on divisibility by 16."""
    from stages.c_optimized import backward, decode_backward

    sizes = {"H", "Hq", "Hkv", "N", "N_Q", "N_K", "Nq", "Nk", "CAUSAL_OFFSET", "CHUNK", "ROWS_TOTAL", "SPLITS",
             "n_m", "total"}
    for kernel in (kernels.optimized_attention_kernel, decode.split_kv_attention_kernel,
                   decode.merge_splits_kernel, hopper_ws.ws_attention_kernel, backward.attention_bwd_delta_kernel,
                   backward.attention_bwd_dkdv_kernel, backward.attention_bwd_dq_kernel,
                   decode_backward.split_kv_backward_kernel, decode_backward.reduce_dq_kernel):
        jit = _jit_function(kernel)
        for param in jit.params:
            if param.name in sizes:
                assert param.do_not_specialize, f"{jit.fn.__name__}: {param.name} is specialized"
            if param.name.startswith("stride_"):
                assert not param.do_not_specialize, f"{jit.fn.__name__}: {param.name} lost its alignment facts"


@pytest.mark.parametrize("how", ["enter hook", "exit hook", "debug", "switched off"])
def test_hooks_debug_and_the_switch_force_the_ordinary_path(monkeypatch, how):
    choice, recipe, (q, k, v, o) = _recording_recipe(monkeypatch, "tl-tma")
    jit = recipe.launches[0].kernel
    _call(recipe, choice, q, k, v, o)  # compiled and kept
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
        _call(recipe, choice, q, k, v, o)
        _call(recipe, choice, q, k, v, o)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert (len(jit.bound), len(jit.launched)) == (3, 0)
    monkeypatch.undo()
    monkeypatch.setattr(launch, "_driver_getters", lambda: ((lambda: 0), (lambda device: 7)))
    assert not launch.launch_hooks_active()
    _call(recipe, choice, q, k, v, o)
    assert (len(jit.bound), len(jit.launched)) == (3, 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on a machine without a GPU")
def test_the_interpreter_never_takes_the_lean_path():
    q, k, v = make_qkv(1, 2, 40, 16, torch.float32, "cpu")
    o = kernels.attention(q, k, v, causal=True)
    check_against_reference(o, q, k, v, causal=True, dtype_name="fp32")
    _, recipe = kernels._plan_call(q, k, v, new_output(q), None, True, 80, kernels._arch_and_sms(q)[1])
    assert all(not r.launcher._compiled for r in recipe.launches)


def test_a_launch_must_name_every_parameter_once():
    kernel = kernels.decode.merge_splits_kernel
    names = list(kernel.arg_names)
    with pytest.raises(ValueError, match="each parameter"):
        launch.FastLaunch(kernel, {n: 1 for n in names[1:]}, (), pointers=0)
    with pytest.raises(ValueError, match="each parameter"):
        launch.FastLaunch(kernel, {n: 1 for n in names}, (names[0],), pointers=1)
    fl = launch.FastLaunch(kernel, {n: i for i, n in enumerate(names[1:])}, (names[0],), pointers=1)
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
    choice, recipe = kernels._plan_call(q, k, v, ordinary, None, causal, *kernels._arch_and_sms(q),
                                        **{**dict(config=None, split_kv=None, ws_rung=None), **options})
    assert choice.path == recipe.path == path
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
@pytest.mark.parametrize("Hq,Hkv,D", [(12, 12, 64), (16, 4, 128), (8, 8, 72)])
def test_gpu_growing_kv_cache_neither_compiles_nor_leaves_the_lean_path(monkeypatch, Hq, Hkv, D):
    """On the GPU: a decode loop, Nk growing by one key per call, is right at every step and, after
    its first two calls, never goes through Triton's ordinary path (so never compiles)."""
    calls = []
    for nk in range(500, 540):
        q, k, v = make_qkv(4, Hq, 1, D, torch.bfloat16, "cuda", Hkv=Hkv, Nk=nk)
        if nk == 502:
            _, recipe = kernels._plan_call(q, k, v, new_output(q), None, True, *kernels._arch_and_sms(q))
            calls = _counting(monkeypatch, recipe)
        o = kernels.attention(q, k, v, causal=True)
        check_against_reference(o, q, k, v, causal=True, dtype_name="bf16")
    assert not calls, f"{len(calls)} calls went through JITFunction.run after the first two"


def _switched_launch_gives_the_same_bits(monkeypatch, module, switch: str, call, refresh) -> tuple:
    """Calls with ``module.<switch>`` on against the same calls with it off, bit for bit (the output and,
    where ``call`` returns one, the log-sum-exp): eagerly (twice per round: the first call binds the
    launches, the second takes the bound path) and replayed from a CUDA graph captured with it on, each
    after ``refresh()`` put new data into the inputs. Returns the last (output, lse)."""

    def use(on: bool) -> None:
        monkeypatch.setattr(module, switch, on)
        kernels._recipe.cache_clear()
        kernels._LAYOUT_PLANS.clear()

    def check(got, expected) -> None:
        for a, b in zip(got, expected):
            assert (a is None and b is None) or torch.equal(a, b)

    try:
        for _ in range(2):
            refresh()
            use(False)
            expected = call()
            use(True)
            for _ in range(2):
                check(call(), expected)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = call()  # (switched on, the launches bound above)
        use(False)
        for _ in range(3):
            refresh()
            graph.replay()
            check(got, call())
        return got
    finally:
        kernels._recipe.cache_clear()
        kernels._LAYOUT_PLANS.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv,Nk,store_lse", [(32, 8, 32768, False), (12, 12, 700, True)])
def test_gpu_early_merge_is_the_ordinary_merge_eagerly_and_in_graph_replay(monkeypatch, Hq, Hkv, Nk, store_lse):
    """The merge launched early (``decode.EARLY_MERGE``, sm_90) gives the ordinary merge's output and
    log-sum-exp bit for bit, called eagerly and replayed from a CUDA graph with new data each time
    (so a merge that read partials before the split kernel wrote them would show)."""
    decode = kernels.decode
    q, k, v = make_qkv(1, Hq, 1, 128, torch.bfloat16, "cuda", Hkv=Hkv, Nk=Nk)
    if kernels._arch_and_sms(q)[0] < 90:
        pytest.skip("programmatic dependent launch needs sm_90")

    def call():
        if store_lse:
            return kernels.attention_with_lse(q, k, v, causal=True)
        return kernels.attention(q, k, v, causal=True), None

    def refresh():
        k.normal_()
        v.normal_()

    arch, sms = kernels._arch_and_sms(q)
    choice, _ = kernels._plan_call(q, k, v, new_output(q), None, True, arch, sms)
    # (a decoding call's config counts its splits per call: splits = 0 in the kept choice)
    assert choice.path == "split" and decode.decode_splits(1, Hkv, Hq // Hkv, 1, Nk, 128, sms) > 1
    _switched_launch_gives_the_same_bits(monkeypatch, decode, "EARLY_MERGE", call, refresh)
    check_against_reference(call()[0], q, k, v, causal=True, dtype_name="bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,N,D,causal,store_lse", [(128, 16, 128, 64, False, False), (2, 8, 1000, 128, True, True)])
def test_gpu_ws_forward_as_a_programmatic_dependent_launch_is_the_ordinary_one(monkeypatch, B, H, N, D, causal,
                                                                                store_lse):
    """The warp-specialized forward launched as a programmatic dependent launch (``hopper_ws.PDL``) gives
    the ordinary launch's output and log-sum-exp bit for bit, called eagerly and replayed from a CUDA
    graph, each call right after a copy kernel writes new values into q and v (a program that read them
    before that kernel ended would see the values the zeroing left)."""
    q, k, v = make_qkv(B, H, N, D, torch.bfloat16, "cuda")
    arch, sms = kernels._arch_and_sms(q)
    if arch != 90:
        pytest.skip("the warp-specialized kernel and programmatic dependent launch: sm_90")
    assert kernels.select(B, H, H, N, N, D, q.dtype, causal, arch, sms).path == "ws"
    fresh_q, fresh_v = torch.randn_like(q), torch.randn_like(v)

    def call():
        q.copy_(fresh_q)  # (the kernels just ahead of the attention's in the stream)
        v.copy_(fresh_v)
        if store_lse:
            return kernels.attention_with_lse(q, k, v, causal=causal)
        return kernels.attention(q, k, v, causal=causal), None

    def refresh():
        fresh_q.normal_()
        fresh_v.normal_()
        q.zero_()
        v.zero_()

    _switched_launch_gives_the_same_bits(monkeypatch, hopper_ws, "PDL", call, refresh)
    check_against_reference(call()[0], q, k, v, causal=causal, dtype_name="bf16")


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


@pytest.mark.gpu
@pytest.mark.parametrize("D,causal", [(64, False), (128, True)])
def test_gpu_bound_launches_find_tensor_maps_by_address_and_stay_right(monkeypatch, D, causal):
    """On sm_90 the forward's and the backward's descriptor kernels, once bound, reach Triton's C
    launcher with tensor maps kept by address (``launch._FlatArguments``). Calls with fresh tensors
    (new addresses), with tensors freed and allocated again (old addresses, new data) and with the
    same tensors holding new data: the forward equals Triton's ordinary launch bit for bit and the
    gradients match the float64 reference each time."""
    from stages.c_optimized import backward as bwd

    probe = make_qkv(1, 4, 256, D, torch.bfloat16, "cuda")[0]
    if kernels._arch_and_sms(probe)[0] != 90:
        pytest.skip("the tensor-map kernels run on sm_90")
    kernels._LAYOUT_PLANS.clear()
    bwd._KEPT.clear()
    held = None
    for step in range(6):
        q, k, v = make_qkv(2, 4, 384, D, torch.bfloat16, "cuda", seed=step)
        if step == 4:
            held = (q, k, v)  # kept alive: the next step's tensors take new addresses
        if step == 5:
            q, k, v = held
            for t in (q, k, v):
                t.normal_()  # the same tensors and addresses, new data
        monkeypatch.setattr(launch, "fast_launch_enabled", False)
        ordinary = kernels.attention(q, k, v, causal=causal)
        monkeypatch.setattr(launch, "fast_launch_enabled", True)
        assert torch.equal(kernels.attention(q, k, v, causal=causal), ordinary), f"step {step}"
        check_gradients(stages.STAGES["c"].attention, q, k, v, causal=causal, dtype_name="bf16")
    forward = [b for p in kernels._LAYOUT_PLANS.values() if p.bound for b, *_ in p.bound.launches]
    backward = [b.bound for kept in bwd._KEPT.values() if kept.bound for b in kept.bound]
    for name, bound in (("forward", forward), ("backward", backward)):
        with_descs = [b for b in bound if any(d is not None for d in b._descs)]
        assert with_descs and all(b._raw is not None for b in with_descs), \
            f"a bound {name} launch with descriptors went through Triton's wrapper"
