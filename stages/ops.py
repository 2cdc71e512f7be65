"""Each stage as a PyTorch custom op: what ``torch.compile``, CUDA graphs and autograd need from a kernel.

A Triton kernel call is Python that reads ``data_ptr()``, asks the driver for the current stream and
keeps caches of compiled kernels. ``torch.compile`` cannot trace that: Dynamo would break the graph
there (or fail under ``fullgraph=True``), and AOTAutograd could not see what the backward needs. So
every stage registers its kernels as operators in the ``attention_lab`` library
(``torch.library.custom_op``), one for the forward and one for the backward, each with

* a *fake* implementation: given tensors that carry only shapes, dtypes and strides, it returns
  outputs of the right shape, dtype and layout, which is all the tracer needs to know;
* its autograd formula (``register_autograd``): what the forward saves and which op computes the
  gradients, so AOTAutograd puts the backward op into the backward graph.

To a traced program the attention call is then one opaque node, the way ``aten`` ops are; at run
time the node calls the real implementation, which launches the kernels.

Why eager calls skip the dispatcher. Going through ``torch.ops`` costs a trip through PyTorch's C++
dispatcher into Python and back, and a registered autograd formula another: measured on a 2-core
CPU at about 15 µs per call without gradients and 50 µs with them, on top of a stage C call whose
whole host path is a few tens of µs. A decode loop calls attention once per layer per token, so
that would be the largest cost in it. The stages therefore call their implementation directly
when nothing is tracing (:func:`traced` is False) and through the op otherwise. Both run the same
functions: the op's implementation, and an ``autograd.Function`` built from the same forward,
``setup_context`` and backward that the op registers (:func:`autograd_function`).
"""

from __future__ import annotations

import torch

#: the ``torch.library`` namespace of the lab's ops: ``torch.ops.attention_lab.c_forward`` and so on
LIBRARY = "attention_lab"


def traced(*tensors: torch.Tensor) -> bool:
    """True while a tracer runs this call: Dynamo (``torch.compile``, ``torch.export``), or AOTAutograd,
    ``make_fx`` and other tracers that hand the code tensor subclasses (fake or functional tensors).
    Then a stage must be called through its custom op; otherwise directly."""
    if torch.compiler.is_compiling():
        return True
    for t in tensors:
        if type(t) is not torch.Tensor:  # FakeTensor, FunctionalTensor, a Parameter (the op handles it too)
            return True
    return False


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
    the rest of the call's host path. (The separate form is what ``torch.func`` transforms need;
    traced calls go through the custom op, which keeps it.)"""
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
