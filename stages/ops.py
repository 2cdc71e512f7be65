"""Each stage as a PyTorch custom op: what ``torch.compile``, CUDA graphs and autograd need from a kernel.

A Triton kernel call is Python that reads ``data_ptr()``, asks the driver for the current stream and
keeps caches of compiled kernels. ``torch.compile`` cannot trace that: Dynamo would break the graph
there (or fail under ``fullgraph=True``), and AOTAutograd could not see what the backward needs. So
every stage registers its kernels as operators in the ``attention_lab`` library (:func:`define`),
one for the forward and one for the backward, each with

* a *fake* implementation: given tensors that carry only shapes, dtypes and strides, it returns
  outputs of the right shape, dtype and layout, which is all the tracer needs to know;
* its autograd formula: what the forward saves and which op computes the gradients, so
  AOTAutograd puts the backward op into the backward graph.

To a traced program the attention call is then one opaque node, the way ``aten`` ops are; at run
time the node calls the real implementation, which launches the kernels.

Why eager calls skip the dispatcher. Going through ``torch.ops`` costs at least one trip from
PyTorch's C++ dispatcher into Python and back, with every argument converted on the way (below: 7 µs
on a 2-core CPU for stage C's forward), on top of a stage C call whose whole host path is a few tens
of µs. A decode loop calls attention once per layer per token, so that would be a large share of its
cost. The stages therefore call their implementation directly when nothing is tracing (:func:`traced`
is False) and through the op otherwise. Both run the same functions: the op's implementation, and an
``autograd.Function`` built from the same forward, ``setup_context`` and backward that the op
registers (:func:`autograd_function`).

Why not ``torch.library.custom_op``. A compiled graph does go through the dispatcher, on every
call, and there ``custom_op``'s layers cost more than the crossing itself: its autograd kernel is
Python that re-enters the dispatcher to reach the implementation (a second crossing into Python),
and the arguments are converted at each crossing. Measured on a 2-core CPU with a do-nothing op of
stage C's forward's 18 arguments: 22 µs a call through ``custom_op`` with an autograd formula,
7 µs through :func:`define`'s one crossing, 2 µs for the Python call alone. :func:`define`
registers the same pieces with ``torch.library.Library`` and writes the autograd kernel itself: it
calls the implementation straight away when no gradient is wanted and no tracer is listening.
"""

from __future__ import annotations

import torch

#: the ``torch.library`` namespace of the lab's ops: ``torch.ops.attention_lab.c_forward`` and so on
LIBRARY = "attention_lab"


def traced(*tensors: torch.Tensor) -> bool:
    """True while a tracer runs this call: Dynamo (``torch.compile``, ``torch.export``), or AOTAutograd,
    ``make_fx`` and other tracers that hand the code tensor subclasses (fake or functional tensors) or
    listen from a dispatch mode, or a ``torch.func`` transform. Then a stage must be called through
    its custom op; otherwise directly."""
    if torch.compiler.is_compiling():
        return True
    return not _plain(tensors)


def _plain(tensors) -> bool:
    """Whether a call on ``tensors`` (its tensor arguments; None for an optional one not given) can run
    the implementation itself: every tensor a plain ``torch.Tensor`` (not a FakeTensor,
    FunctionalTensor or Parameter, which the op handles), no ``__torch_dispatch__`` mode that would
    record or intercept the op (``make_fx``, ``FlopCounterMode``), no ``torch.func`` transform (``vmap``
    wraps tensors below autograd)."""
    if torch._C._len_torch_dispatch_stack() or torch._C._are_functorch_transforms_active():
        return False
    for t in tensors:
        if t is not None and type(t) is not torch.Tensor:
            return False
    return True


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd will want gradients of a call on these inputs."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def maybe_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim is contiguous, else a contiguous copy. A gradient may arrive in
    any layout: the gradient of ``o.sum()`` is a single value expanded to o's shape (every stride 0),
    and the kernels address the head dim as contiguous memory. Other strides they take as they come."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def empty_output(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous tensor shaped like ``like``: what every stage's outputs and gradients are, so the
    fake implementations return exactly the layout the real ones do."""
    return torch.empty(like.shape, dtype=dtype or like.dtype, device=like.device)


def autograd_function(name: str, forward, setup_context, backward) -> type[torch.autograd.Function]:
    """An ``autograd.Function`` made of the same three functions a custom op registers with
    ``register_autograd``, for the eager path: ``forward(*inputs) -> outputs``,
    ``setup_context(ctx, inputs, outputs)`` and ``backward(ctx, *output_grads)``.

    The Function's ``forward`` takes ``ctx`` and calls ``setup_context`` itself, rather than
    declaring ``setup_context`` beside it: for a Function that declares one, every ``apply`` binds
    its arguments to ``forward``'s signature with ``inspect.signature`` (to fill in defaults), which
    for the 16 arguments of stage C's forward costs about 37 µs per call on a 2-core CPU, more than
    the rest of the call's host path. (The separate form is what ``torch.func`` transforms need, and
    the lab's ops do not support those transforms.)"""
    def forward_with_ctx(ctx, *inputs):
        outputs = forward(*inputs)
        setup_context(ctx, inputs, outputs)
        # The second output (the row log-sum-exp, or stage A's P) is marked non-differentiable, and
        # autograd would hand the backward a zero tensor for it, made on every call: None instead.
        ctx.set_materialize_grads(False)
        return outputs

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward_with_ctx),
        "backward": staticmethod(backward),
    })


#: the registrations of the lab's ops (kept for the life of the process: a Library object that is
#: garbage-collected takes its registrations with it)
_LIB = torch.library.Library(LIBRARY, "FRAGMENT")


def define(name: str, implementation, fake, *, setup_context=None, backward=None) -> torch._ops.OpOverload:
    """Register ``implementation`` as the operator ``attention_lab::<name>`` and return it
    (``torch.ops.attention_lab.<name>.default``).

    The schema is read from ``implementation``'s type annotations (``torch.library.infer_schema``; no
    argument is mutated). ``fake(*args)`` returns outputs of the real ones' shapes, dtypes and layout
    for tracing. ``setup_context(ctx, inputs, outputs)`` and ``backward(ctx, *output_grads)`` make it
    differentiable, as ``register_autograd`` would; without them it is not.

    The op's autograd kernel is written here (module docstring: one crossing instead of two). Asked
    for gradients, it runs an ``autograd.Function`` whose forward calls the op again with grad mode
    off. Otherwise it calls ``implementation`` directly when the call is plain (:func:`_plain`), and
    else passes the call on below autograd, where a tracer's mode or the fake implementation sees it.
    """
    _LIB.define(name + torch.library.infer_schema(implementation, mutates_args=()))
    _LIB.impl(name, implementation, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{LIBRARY}::{name}", fake, lib=_LIB)
    op = getattr(getattr(torch.ops, LIBRARY), name).default
    differentiable = None
    if backward is not None:
        differentiable = autograd_function(f"{name}_autograd", op, setup_context, backward)
    below_autograd = torch._C._after_autograd_keyset
    # Where the schema takes a tensor: the kernel looks at those arguments only (the dispatcher may
    # leave trailing arguments at their defaults out, hence the length check).
    tensor_type = torch._C.OptionalType.ofTensor()
    tensor_at = tuple(i for i, a in enumerate(op._schema.arguments) if a.type.isSubtypeOf(tensor_type))

    def autograd_kernel(keyset, *args):
        tensors = [args[i] for i in tensor_at if i < len(args)]
        if differentiable is not None and torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in tensors):
            return differentiable.apply(*args)
        if _plain(tensors):
            return implementation(*args)
        return op.redispatch(keyset & below_autograd, *args)

    _LIB.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    return op
