"""A kernel launch written down as data, so the same description can be run or compiled.

Each stage turns a problem into a list of :class:`Launch` es. ``attention`` runs them; ``compile``
hands the same launches to Triton's compiler for an sm_80 or sm_90 target, which needs no GPU. So the
PTX that ``harness inspect`` and the compiled-code tests read is the code the GPU would run, with
the same tiles, warps, pipeline depth and pointer alignment, not a lookalike.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.knobs import HookChain
from triton.runtime.jit import mangle_type

from .contract import CompiledKernel


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class Launch:
    kernel: triton.JITFunction
    grid: tuple
    args: dict                      # every kernel parameter by name, constexprs included
    num_warps: int = 4
    num_stages: int = 1
    extra: dict = field(default_factory=dict)  # other launch options (e.g. maxnreg)

    def run(self) -> None:
        self.kernel[self.grid](**self.args, num_warps=self.num_warps, num_stages=self.num_stages, **self.extra)

    def specialization(self) -> tuple[dict, dict, dict]:
        """(signature, constexprs, attrs) as Triton's launcher would specialize this launch: each
        argument's type, the constexpr values, and ``tt.divisibility = 16`` for pointers to 16-byte
        aligned memory and integers divisible by 16. An integer equal to 1 becomes a constexpr, as
        Triton 3.6 makes it; parameters the kernel lists in ``do_not_specialize`` (sequence lengths,
        head counts) keep only their type. Two launches with equal specializations and options
        compile to the same binary."""
        signature, constexprs, attrs = {}, {}, {}
        for i, name in enumerate(self.kernel.arg_names):
            value = self.args[name]
            param = self.kernel.params[i]
            specialize = not param.do_not_specialize
            if param.is_constexpr or value is None or (specialize and _is_int(value) and value == 1):
                signature[name] = "constexpr"  # None arguments and integers equal to 1 are constexpr to the JIT
                constexprs[name] = value
                continue
            signature[name] = mangle_type(value)
            aligned = (isinstance(value, torch.Tensor) and value.data_ptr() % 16 == 0) or (
                specialize and _is_int(value) and value % 16 == 0)
            if aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
        return signature, constexprs, attrs

    def compile(self, arch: int) -> CompiledKernel:
        """Compile for ``cuda:arch`` (80 or 90), specializing arguments as the JIT would on a GPU.

        Like Triton's launcher, pointers to 16-byte aligned memory and integers divisible by 16 are
        marked ``tt.divisibility = 16``: that is what licenses 16-byte vector loads and ``cp.async``.
        """
        fn = self.kernel
        signature, constexprs, attrs = self.specialization()
        source = ASTSource
        if getattr(fn, "is_gluon", lambda: False)():
            from triton.experimental.gluon._runtime import GluonASTSource as source
        src = source(fn, signature, constexprs=constexprs, attrs=attrs)
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages, **self.extra}
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        return CompiledKernel(name=fn.__name__, asm=dict(compiled.asm), shared_bytes=int(compiled.metadata.shared),
                              num_warps=self.num_warps, num_stages=self.num_stages)


# --------------------------------------------------------------------------------------------------
# The lean launch. `kernel[grid](**args)` is Triton's general entry: for every call it binds the
# keyword arguments, works out how each argument specializes the kernel (type, 16-byte alignment,
# divisibility by 16, == 1), hashes all that into a cache key, finds the compiled kernel and only
# then calls its launcher. With ~30 arguments that Python costs tens of µs, more than a small
# attention problem takes on the GPU. A stage that calls the same launch again and again with only
# its tensors changing can do that work once and keep the compiled kernel.
# --------------------------------------------------------------------------------------------------

#: False: every FastLaunch takes ``kernel[grid](...)`` (for comparing the two paths' results and times)
fast_launch_enabled = True


def launch_hooks_active() -> bool:
    """True while something (a profiler such as proton, a test) listens to Triton's launches, or
    Triton's runtime debug mode is on: then only ``kernel[grid](...)`` does everything it should."""
    runtime = knobs.runtime
    if runtime.debug:
        return True
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        # Triton 3.6 keeps an (empty) HookChain here; older code may assign a function or None.
        if hook is not None and not (type(hook) is HookChain and not hook.calls):
            return True
    return False


def _driver_getters():
    """(current device index, raw stream of a device): the two functions Triton's own launch path
    asks (``torch.cuda.current_device`` and ``torch._C._cuda_getCurrentRawStream`` on NVIDIA).
    Resolved on first use, because asking Triton's driver needs a GPU."""
    from triton.runtime import driver

    return driver.active.get_current_device, driver.active.get_current_stream


class FastLaunch:
    """A launch of ``kernel`` whose options and every argument but a few per-call ``dynamic`` ones
    are fixed, called as ``launch(grid, *values)`` with the grid and those values (tensors first:
    ``pointers`` of them are pointer arguments).

    The first call goes through ``kernel[grid](...)``, which compiles if needed and returns the
    CompiledKernel; it is kept, and later calls hand the arguments (every parameter in order,
    constexprs included, exactly what ``JITFunction.run`` passes) to its launcher directly.

    A kept kernel is reused only where Triton would pick the same one. Triton specializes each
    argument on its type and value facts: pointers on their dtype and 16-byte alignment; integers
    on being 1 (then a constexpr), divisible by 16, or wider than 32 bits, except the parameters
    the kernel declares ``do_not_specialize``, which keep only their type; None and constexprs on
    their value. So this cache's key is the current device, the pointers' alignment and those
    integer facts of the dynamic integers: a sequence length declared ``do_not_specialize`` can
    change at every call and still find its kernel, which is what lets a decode loop whose KV cache
    grows by one key per call launch as cheaply as a fixed-shape one. A call with an integer wider
    than 32 bits takes Triton's own path (rare: strides of tensors past 2^31 elements). The caller
    guarantees the rest: the other dynamic values specialize the same way at every call (pointers
    of one dtype, descriptors of one dtype and block shape, Python floats).

    Not taken (``kernel[grid](...)`` instead): under the interpreter, while launch hooks are active
    or Triton's debug mode is on (:func:`launch_hooks_active`), for a kernel with pre-run hooks. Two
    checks of ``kernel[grid]`` are skipped: that global values a kernel reads did not change since
    it was compiled, and the cache invalidation of edits to the kernel's source while running; and
    Triton's check that each pointer is a GPU address (the stage's input checks make sure of it).
    """

    def __init__(self, kernel, static: dict, dynamic: tuple, *, pointers: int, num_warps: int = 4,
                 num_stages: int = 1, extra: dict | None = None, fast: bool | None = None):
        from . import interpreted

        names = list(kernel.arg_names)
        # Parameters left out take their default, as Triton's binder would give them.
        defaults = {name: p.default for name, p in inspect.signature(kernel.fn).parameters.items()
                    if p.default is not inspect.Parameter.empty and name not in dynamic}
        static = {**defaults, **static}
        named_once = len(dynamic) == len(set(dynamic)) and not set(static) & set(dynamic)
        if not named_once or (set(static) | set(dynamic)) != set(names):
            raise ValueError(f"static and dynamic must name each parameter of {kernel.fn.__name__}{tuple(names)} "
                             f"once (those with defaults may be left out); got static {sorted(static)}, dynamic "
                             f"{list(dynamic)}")
        self.kernel = kernel
        self.names = names
        self.dynamic = tuple(dynamic)
        self.options = dict(num_warps=num_warps, num_stages=num_stages, **(extra or {}))
        self._template = [static.get(name) for name in names]    # dynamic slots are filled per call
        self._slots = tuple(names.index(name) for name in dynamic)
        self._pointers = pointers
        self._fast = (not interpreted()) if fast is None else fast
        self._compiled = {}  # (device, pointer facts, integer facts) -> _kept(compiled kernel)
        self._get_device = self._get_stream = None
        self._int_slots = None  # (specialized, unspecialized) positions of integer values, found on the first call

    def arguments(self, *values) -> list:
        """Every kernel argument in parameter order, for these dynamic ``values``."""
        args = self._template.copy()
        for slot, value in zip(self._slots, values):
            args[slot] = value
        return args

    def _integer_facts(self, values) -> tuple | None:
        """What Triton's specialization reads off the dynamic integers, per specialized one: equal to 1,
        divisible by 16, or neither; None when any integer is wider than 32 bits."""
        if self._int_slots is None:
            params = getattr(self.kernel, "params", None)
            specialized, unspecialized = [], []
            for i, value in enumerate(values):
                if _is_int(value):
                    dns = params is not None and params[self._slots[i]].do_not_specialize
                    (unspecialized if dns else specialized).append(i)
            self._int_slots = (tuple(specialized), tuple(specialized + unspecialized))
        specialized, every = self._int_slots
        if every:
            ints = [values[i] for i in every]
            if max(ints) > 0x7FFFFFFF or min(ints) < -0x80000000:
                return None
        # True (== 1), 2 (divisible by 16) or False (neither): three facts that compare unequal
        return tuple([x == 1 or (x % 16 == 0 and 2) for x in [values[i] for i in specialized]])

    def prepare(self, grid: tuple, *values) -> None:
        """Compile (without launching) the kernel a call with these values would take, and keep it:
        for a kernel a loop will need only later (the merge of split-KV decoding, first needed
        when the cache grows long enough to split), so its compilation is not paid mid-loop."""
        if not (self._fast and fast_launch_enabled and not launch_hooks_active()):
            return
        facts = self._integer_facts(values)
        if facts is None:
            return
        if self._get_device is None:
            self._get_device, self._get_stream = _driver_getters()
        key = (self._get_device(), tuple([t.data_ptr() % 16 == 0 for t in values[:self._pointers]]), facts)
        if key not in self._compiled and not getattr(self.kernel, "pre_run_hooks", None):
            args = self.arguments(*values)
            compiled = self.kernel.warmup(**dict(zip(self.names, args)), grid=tuple(grid), **self.options)
            if compiled is not None:
                self._compiled[key] = _kept(compiled)

    def __call__(self, grid: tuple, *values, facts=None) -> None:
        """Launch on ``grid`` with these dynamic ``values``; ``facts``: their ``_integer_facts``, when
        the caller kept them from an earlier call with the same integers."""
        args = self.arguments(*values)
        key = None
        if self._fast and fast_launch_enabled and not launch_hooks_active():
            if facts is None:
                facts = self._integer_facts(values)
            if facts is not None:
                n = self._pointers
                addresses = [t.data_ptr() for t in values[:n]]
                # Of what Triton keys its kernels on, only these vary between calls here.
                key = (self._get_device() if self._get_device is not None else None,
                       tuple([a % 16 == 0 for a in addresses]), facts)
                entry = self._compiled.get(key)
                if entry is not None:
                    launcher, function, before_args, _ = entry
                    device = key[0]
                    g0 = grid[0]
                    g1 = grid[1] if len(grid) > 1 else 1
                    g2 = grid[2] if len(grid) > 2 else 1
                    # The pointers go to the launcher as addresses: handed a tensor, it would call
                    # data_ptr() and ask the driver what the address is (cuPointerGetAttribute), per
                    # pointer and call; the stage's checks already put every tensor on the GPU.
                    for slot, address in zip(self._slots, addresses):
                        args[slot] = address
                    launcher(g0, g1, g2, self._get_stream(device), function, *before_args, *args)
                    return
        compiled = self.kernel[tuple(grid)](**dict(zip(self.names, args)), **self.options)
        if key is not None and compiled is not None and not getattr(self.kernel, "pre_run_hooks", None):
            if self._get_device is None:
                self._get_device, self._get_stream = _driver_getters()
                key = (self._get_device(), *key[1:])
            self._compiled[key] = _kept(compiled)

    def bound(self, grid: tuple, values, varying: tuple, facts=None) -> "BoundLaunch | None":
        """This launch with these dynamic ``values`` (a call that has just gone through ``__call__``)
        as a :class:`BoundLaunch`: the kept compiled kernel and every argument in place, but the
        pointers (addresses, per call) and the dynamic values at the indices ``varying`` (per call
        too). The caller keeps it for calls that Triton would specialize the same way (pointer
        alignment and integer facts: its key must hold them). None where calls must go through
        ``__call__``: no lean path here, an integer past 32 bits, or no compiled kernel kept."""
        if not (self._fast and fast_launch_enabled and not launch_hooks_active()) or self._get_device is None:
            return None
        if facts is None:
            facts = self._integer_facts(values)
        if facts is None:
            return None
        n = self._pointers
        device = self._get_device()
        entry = self._compiled.get((device, tuple([t.data_ptr() % 16 == 0 for t in values[:n]]), facts))
        if entry is None:
            return None
        return BoundLaunch(entry, grid, self.arguments(*values), self._slots[:n],
                           tuple(self._slots[i] for i in varying), device, self._get_device, self._get_stream)


class BoundLaunch:
    """One launch of a kept compiled kernel with every argument bound but a few: what a caller keeps
    for a layout it launches again and again (stage C's forward keeps one per launch of a layout, so a
    call of a known layout hands over addresses and a scale, not tensors to be checked, keyed and
    bound). ``launch(addresses, varying)`` writes the pointer arguments (integer addresses, in the
    kernel's order) and the other per-call values into a copy of the bound argument list and calls
    the launcher; a TMA descriptor argument among ``varying`` is handed over as its tensor (the
    descriptor's shape, strides and block are the binding call's: the caller's key holds them). The
    caller checks first what the binding assumed: :meth:`open` (no launch hooks, the lean path on,
    the bound device current).

    **Descriptors by address.** Triton's launcher flattens each descriptor on every call, through a
    Python wrapper that walks every argument: into the 128-byte tensor map the kernel reads, made on
    the host (``cuTensorMapEncodeTiled``), for a Gluon kernel; into its base tensor, whose address the
    C launcher then asks the driver about, for a ``tl`` kernel that makes its descriptors on the GPU.
    A tensor map depends on the base address and on what the binding fixed (shape, strides, block,
    swizzle), so a bound launch keeps the maps it has made by address, hands a base over as its
    address, and calls the compiled C launcher with the flattened arguments itself
    (:func:`_descriptor_launch`, :class:`_FlatArguments`). A model calls with the same few addresses
    step after step (PyTorch's caching allocator hands the same blocks back), so after its first steps
    no map is made again. Each descriptor keeps at most :data:`TENSOR_MAPS_KEPT` maps."""

    __slots__ = ("_entry", "_grid", "_args", "_pointer_slots", "_varying_slots", "device", "_get_device",
                 "_get_stream", "_descs", "_raw")

    def __init__(self, entry, grid, args, pointer_slots, varying_slots, device, get_device, get_stream):
        self._entry = entry
        self._grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        # Per varying value, for a descriptor: (its class, its fields but the base), to build one over
        # a call's tensor where the launcher needs the object; None for any other value.
        self._descs = tuple((type(args[slot]), {k: v for k, v in vars(args[slot]).items() if k != "base"})
                            if _is_descriptor(args[slot]) else None for slot in varying_slots)
        self._raw = _FlatArguments.of(entry, args, pointer_slots, varying_slots)
        # The binding call's tensors and descriptors leave the kept list (every call writes its own
        # into those slots): kept, they would hold that call's memory for as long as the layout is
        # known, and inside a CUDA-graph pool PyTorch refuses memory that outlives the graph's outputs.
        args = list(args)
        for slot in (*pointer_slots, *varying_slots):
            args[slot] = None
        self._args = args
        self._pointer_slots = tuple(pointer_slots)
        self._varying_slots = tuple(varying_slots)
        self.device = device
        self._get_device = get_device
        self._get_stream = get_stream

    def open(self) -> bool:
        """Whether this bound launch may run now: the lean path is on, nothing listens to Triton's
        launches and the bound device is the current one (the launcher runs on the current device's
        stream, as Triton's own path would)."""
        return fast_launch_enabled and not launch_hooks_active() and self._get_device() == self.device

    def launch(self, addresses, varying=()) -> None:
        g0, g1, g2 = self._grid
        stream = self._get_stream(self.device)
        raw = self._raw
        if raw is not None:
            raw.launch(g0, g1, g2, stream, addresses, varying, self._descs)
            return
        # A copy per call: the bound list is shared, and a launch from another thread must not see
        # this call's addresses half written.
        args = self._args.copy()
        for slot, address in zip(self._pointer_slots, addresses):
            args[slot] = address
        for slot, value, desc in zip(self._varying_slots, varying, self._descs):
            args[slot] = value if desc is None else descriptor_on(desc[0], desc[1], value)
        launcher, function, before_args, _ = self._entry
        launcher(g0, g1, g2, stream, function, *before_args, *args)


#: Tensor maps a bound launch keeps per descriptor argument, by base address (``BoundLaunch``): a model's
#: layers each bring their own tensors, so this many layers of one layout find theirs kept.
TENSOR_MAPS_KEPT = 256
#: (``_FlatArguments``) a descriptor the kernel builds on the GPU from its base, shape and strides: the
#: launcher takes the base's address
_BY_ADDRESS = "by address"


class _FlatArguments:
    """A bound launch of a kernel with TMA descriptors as the compiled C launcher takes it. Triton's
    wrapper (``wrap_handle_tensordesc``) flattens each descriptor on every call: into its tensor map,
    shape and strides where the compiler lowered it to a host-made map (Gluon kernels), else into its
    base tensor, shape, strides and padding, the kernel making the descriptor on the GPU (``tl`` kernels
    here), where the launcher then asks the driver about the base tensor's address. Here shape, strides
    and padding are the binding's; a map comes from a table keyed by the base address, made (by
    Triton's own ``make_tensordesc_arg``) only for an address not seen; a base goes as its address."""

    __slots__ = ("_launcher", "_before", "_flat", "_pointer_at", "_varying_at", "_metas", "_maps")

    @classmethod
    def of(cls, entry, args, pointer_slots, varying_slots) -> "_FlatArguments | None":
        """For a kept kernel whose launcher takes descriptors (``_kept``'s fourth item) and a binding
        whose descriptors are all among the varying values; None otherwise (the launcher whole)."""
        if entry[3] is None:
            return None
        launcher, metas, before = entry[3]
        make = _make_tensordesc_arg()
        desc_slots = [i for i, a in enumerate(args) if _is_descriptor(a)]
        if make is None or len(desc_slots) != len(metas) or not set(desc_slots) <= set(varying_slots):
            return None
        self = object.__new__(cls)
        flat, at, meta_of, maps = [], {}, dict(zip(desc_slots, metas)), {}
        for i, a in enumerate(args):
            at[i] = len(flat)
            if i in meta_of:
                # [tensor map or base, *the rest] as the wrapper makes it for the binding call
                expanded = make(a, meta_of[i])
                if meta_of[i] is None:
                    if expanded[0] is not a.base:
                        return None  # (a flattening of another shape than Triton 3.6's)
                    maps[i] = _BY_ADDRESS
                else:
                    maps[i] = {a.base.data_ptr(): expanded[0]}
                flat.extend([None, *expanded[1:]])
            else:
                flat.append(None if i in pointer_slots or i in varying_slots else a)
        self._launcher, self._before, self._flat = launcher, (entry[1], *before), flat
        self._pointer_at = tuple(at[s] for s in pointer_slots)
        self._varying_at = tuple(at[s] for s in varying_slots)
        self._metas = tuple(meta_of.get(s) for s in varying_slots)
        self._maps = tuple(maps.get(s) for s in varying_slots)
        return self

    def launch(self, g0, g1, g2, stream, addresses, varying, descs) -> None:
        flat = self._flat.copy()
        for at, address in zip(self._pointer_at, addresses):
            flat[at] = address
        for at, value, maps, meta, desc in zip(self._varying_at, varying, self._maps, self._metas, descs):
            if maps is None:
                flat[at] = value
            elif maps is _BY_ADDRESS:
                flat[at] = value.data_ptr()
            else:
                address = value.data_ptr()
                tensor_map = maps.get(address)
                if tensor_map is None:
                    if len(maps) >= TENSOR_MAPS_KEPT:
                        maps.clear()
                    desc_now = descriptor_on(desc[0], desc[1], value)
                    tensor_map = maps[address] = _make_tensordesc_arg()(desc_now, meta)[0]
                flat[at] = tensor_map
        self._launcher(g0, g1, g2, stream, *self._before, *flat)


def _make_tensordesc_arg():
    """Triton's ``make_tensordesc_arg`` (descriptor, metadata) -> [tensor map, *shape, *strides], looked
    up per use so a test can stand in for it; None where this Triton has none."""
    try:
        from triton.backends.nvidia import driver as nvidia_driver
    except ImportError:
        return None
    return getattr(nvidia_driver, "make_tensordesc_arg", None)


def _kept(compiled) -> tuple:
    """(launch function, CUfunction, the launch function's arguments between the stream and the
    kernel's, the C launcher for descriptor kernels or None): what :class:`FastLaunch` keeps of a
    CompiledKernel. JITFunction.run ends in ``compiled.run(grid..., stream, function,
    packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``, a Python wrapper (Triton's
    ``CudaLauncher``) that allocates the scratch buffers a kernel may ask for and calls the compiled
    C launcher. A kernel that asks for none (no global or profiler scratch, no TMA descriptors the
    wrapper must unpack) is handed to the C launcher itself, with what the wrapper would pass it; any
    other launcher is kept whole, and for one whose only extra is descriptors the fourth item says how
    to reach its C launcher (:func:`_descriptor_launch`), which bound launches use."""
    run = compiled.run
    direct = getattr(run, "launch", None)
    plain = (type(run).__name__ == "CudaLauncher" and callable(direct)
             and getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0
             and hasattr(run, "launch_cooperative_grid") and hasattr(run, "launch_pdl") and _base_arguments_known())
    before = (run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata, None, None,
              None) if plain else None
    if plain and getattr(direct, "__name__", "") == "launch":
        return direct, compiled.function, before, None
    return run, compiled.function, (compiled.packed_metadata, None, None, None), (
        _descriptor_launch(direct, before) if plain else None)


def _descriptor_launch(wrapper, before) -> tuple | None:
    """(C launcher, each descriptor argument's tensor-map metadata or None, the launcher's arguments
    between the CUfunction and the kernel's) for a kernel with TMA descriptors: Triton 3.6 wraps its C
    launcher in a closure (``wrap_handle_tensordesc``'s ``inner``) that holds both (a None where the
    kernel makes that descriptor on the GPU). None where the wrapper is not that closure."""
    code, closure = getattr(wrapper, "__code__", None), getattr(wrapper, "__closure__", None)
    if code is None or closure is None or getattr(wrapper, "__name__", "") != "inner":
        return None
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in closure)))
    launcher, metas = cells.get("launcher"), cells.get("tensordesc_meta")
    if not callable(launcher) or not isinstance(metas, list) or not metas:
        return None
    return launcher, tuple(metas), before


def _base_arguments_known() -> bool:
    """Whether Triton's C launcher takes the leading arguments :func:`_kept` passes it (grid, stream,
    function, cooperative grid, PDL, two scratch buffers, metadata, launch metadata, two hooks): the
    format string of Triton 3.6's NVIDIA driver."""
    try:
        from triton.backends.nvidia import driver as nvidia_driver
    except ImportError:
        return False
    return getattr(nvidia_driver, "_BASE_ARGS_FORMAT", None) == "iiiKKppOOOOOO"


def descriptor_over(cls, fields: dict, t: torch.Tensor):
    """A TMA descriptor of class ``cls`` over tensor ``t``, its other fields (block shape, padding,
    Gluon's shared-memory layout) from ``fields``, built without the class's checks: the caller
    checked strides and block for this layout once, and a launcher keys on the pointers' alignment.
    The fixed lists in ``fields`` are shared between calls: Triton's launcher only reads them."""
    desc = object.__new__(cls)
    desc.__dict__.update(fields)
    desc.base, desc.shape, desc.strides = t, list(t.shape), list(t.stride())
    return desc


def descriptor_on(cls, fields: dict, base: torch.Tensor):
    """A TMA descriptor of class ``cls`` over ``base`` whose other fields, shape and strides included,
    are ``fields``: :func:`descriptor_over` for a caller that knows the layout already (a bound launch:
    its key holds the shape and strides, and it keeps the binding descriptor's fields), so only the
    base is new per call."""
    desc = object.__new__(cls)
    desc.__dict__.update(fields)
    desc.base = base
    return desc


def _is_descriptor(value) -> bool:
    """A TMA descriptor argument (Triton's host ``TensorDescriptor`` or Gluon's): it wraps a tensor."""
    return hasattr(value, "block_shape") and isinstance(getattr(value, "base", None), torch.Tensor)


class KeptLaunch:
    """A :class:`Launch` planned once and run again on other tensors of the same layout.

    ``roles`` names, for every tensor or TMA-descriptor argument of the launch, which of a call's
    tensors it takes (``{"Q": "q", "q_desc": "q", ...}``); every other argument (sizes, strides,
    scales, constexprs) and the grid stay as planned, so the caller keys what it keeps on everything
    they depend on (shapes, strides, dtype, scale). A call hands over ``{role: tensor}``; a descriptor
    is rebuilt over its tensor from the planned one's fields (:func:`descriptor_over`). Launched through
    :class:`FastLaunch` (the compiled kernel's own launcher after the first call)."""

    def __init__(self, launch: Launch, roles: dict[str, str]):
        static, tensors, descs = {}, [], []
        for name, value in launch.args.items():
            if isinstance(value, torch.Tensor):
                tensors.append((name, roles[name]))
            elif _is_descriptor(value):
                fields = {k: v for k, v in vars(value).items() if k not in ("base", "shape", "strides")}
                descs.append((name, roles[name], type(value), fields))
            else:
                static[name] = value
        self.kernel, self.grid = launch.kernel, tuple(launch.grid)
        self.tensors, self.descs = tuple(tensors), tuple(descs)
        self.fast = FastLaunch(launch.kernel, static, tuple(n for n, _ in tensors) + tuple(d[0] for d in descs),
                               pointers=len(tensors), num_warps=launch.num_warps, num_stages=launch.num_stages,
                               extra=launch.extra)

    def values(self, tensors: dict) -> list:
        values = [tensors[role] for _, role in self.tensors]
        values.extend(descriptor_over(cls, fields, tensors[role]) for _, role, cls, fields in self.descs)
        return values

    def __call__(self, tensors: dict) -> None:
        self.fast(self.grid, *self.values(tensors))

    def bind(self, tensors: dict) -> "BoundKeptLaunch | None":
        """This launch bound after a call with ``tensors`` ran it (:meth:`FastLaunch.bound`): a later
        call of the same layout hands over its tensors (addresses, and the tensors its descriptors are
        over: the bound launch finds their tensor maps by address), nothing else. None where calls must go through ``__call__``. The caller's key must hold what the
        binding assumes: the layout (shapes, strides: the descriptors keep this call's) and each
        pointer's 16-byte alignment."""
        values = self.values(tensors)
        n = len(self.tensors)
        bound = self.fast.bound(self.grid, values, tuple(range(n, len(values))))
        if bound is None:
            return None
        return BoundKeptLaunch(bound, tuple(role for _, role in self.tensors), tuple(d[1] for d in self.descs))


class BoundKeptLaunch:
    """A :class:`KeptLaunch` bound to its compiled kernel (:meth:`KeptLaunch.bind`): per call, the
    tensors' addresses by role and each descriptor's tensor by role (``BoundLaunch`` makes the
    descriptor, or finds its tensor map by address); ``open()`` first."""

    __slots__ = ("bound", "roles", "desc_roles")

    def __init__(self, bound: BoundLaunch, roles: tuple, desc_roles: tuple):
        self.bound, self.roles, self.desc_roles = bound, roles, desc_roles

    def open(self) -> bool:
        return self.bound.open()

    def __call__(self, tensors: dict) -> None:
        self.bound.launch([tensors[role].data_ptr() for role in self.roles],
                          [tensors[role] for role in self.desc_roles])


def meta_inputs(B: int, H: int, N: int, D: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Storage-free stand-ins for q, k, v (``device="meta"``): shapes, strides and dtype, no memory,
    so compiling a plan for N = 16384 allocates nothing."""
    return tuple(torch.empty((B, H, N, D), dtype=dtype, device="meta") for _ in range(3))


# --------------------------------------------------------------------------------------------------
# Compiling while the interpreter is on. Under TRITON_INTERPRET=1 every @triton.jit function is an
# interpreted Python function that the compiler cannot take, and the switch is read once, at import.
# So a stage's compile() hands the job to a child process started with the interpreter off; it
# compiles (no GPU needed) and sends the results back as JSON.
# --------------------------------------------------------------------------------------------------

_TEXT_ASM = ("ttir", "ttgir", "llir", "ptx")


def compiles_without_interpreter(compile_fn):
    """Decorator for a stage's ``compile(problem, arch, **switches)``: runs it in a child process
    with the interpreter off when this process interprets, and as it is otherwise."""
    import functools

    @functools.wraps(compile_fn)
    def wrapper(problem, arch: int, **switches):
        from . import interpreted

        if not interpreted():
            return compile_fn(problem, arch, **switches)
        return _compile_in_child(compile_fn.__module__, compile_fn.__name__, problem, arch, switches)

    return wrapper


def _compile_in_child(module: str, name: str, problem, arch: int, switches: dict) -> list[CompiledKernel]:
    import dataclasses
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    request = {"module": module, "name": name, "problem": dataclasses.asdict(problem), "arch": arch,
               "switches": switches}
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "stages.launch"], input=json.dumps(request, default=_encode),
                          text=True,
                          capture_output=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling {module}.{name} for sm_{arch} failed:\n{compile_error_summary(proc.stderr)}")
    return [CompiledKernel(**k) for k in json.loads(proc.stdout)]


#: lines the compiler child prints that never explain a failure: some Triton builds report every
#: nanobind object still alive at exit, hundreds of lines that would push the real error out of view
_NOISE_PREFIXES = ("nanobind: ",)
#: lines that state a cause: the exception itself, MLIR/LLVM diagnostics, ptxas
_CAUSE_MARKERS = ("error:", "Error:", "ptxas fatal", "ptxas error", "fatal error")


def compile_error_summary(stderr: str, tail_chars: int = 3000) -> str:
    """The compiler child's stderr made readable: noise dropped, the lines that state the cause first
    (the exception line, ``error:`` diagnostics, ``ptxas fatal``), then the last ``tail_chars``
    characters of what is left, for context."""
    lines = [line for line in stderr.splitlines() if not line.startswith(_NOISE_PREFIXES)]
    causes = [line for line in lines if any(marker in line for marker in _CAUSE_MARKERS)]
    # A traceback ends with "SomeError: message" at column 0; it is the cause even without a marker.
    exception_lines = [line for line in lines if line and not line[0].isspace() and ": " in line
                       and line.split(":", 1)[0].endswith(("Error", "Exception")) and line not in causes]
    first = list(dict.fromkeys(causes + exception_lines))
    tail = "\n".join(lines)[-tail_chars:]
    if not first:
        return tail
    return "\n".join(first) + "\n--- end of the compiler's output ---\n" + tail


def _encode(obj) -> dict:
    """Switch values that are not JSON (stage C's ``Config``) travel as text plus a ``parse`` classmethod."""
    return {"__parse__": f"{type(obj).__module__}:{type(obj).__qualname__}", "text": str(obj)}


def _decode(d: dict):
    if "__parse__" not in d:
        return d
    import importlib

    module, name = d["__parse__"].split(":")
    return getattr(importlib.import_module(module), name).parse(d["text"])


def _child_main() -> None:
    import dataclasses
    import importlib
    import json
    import sys

    from .contract import Problem

    request = json.load(sys.stdin, object_hook=_decode)
    fn = getattr(importlib.import_module(request["module"]), request["name"])
    kernels = fn(Problem(**request["problem"]), request["arch"], **request["switches"])
    out = []
    for k in kernels:
        d = dataclasses.asdict(k)
        d["asm"] = {key: k.asm[key] for key in _TEXT_ASM if key in k.asm}
        out.append(d)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    _child_main()
