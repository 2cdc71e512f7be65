"""Every stage as a model calls it: a custom op that ``torch.compile(fullgraph=True)`` traces forward and
backward, whose fake implementation matches the real one, and whose backward takes a gradient of
any layout. On a CPU the kernels run in Triton's interpreter and ``torch.compile`` uses the
``aot_eager`` backend (Dynamo and AOTAutograd trace, no code generation); on a GPU the same tests
run the compiled kernels, and the GPU-marked ones add Inductor and CUDA graphs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import stages
from stages import ops

sys.path.insert(0, str(Path(__file__).parent))
from helpers import check_against_reference, check_gradients, make_qkv  # noqa: E402

STAGE_NAMES = ("a", "b", "c")


def _attention(name):
    return stages.get_stage(name).attention


def _inputs(device, dtype=torch.float32, *, B=2, Hq=4, Hkv=2, Nq=5, Nk=11, D=16, grad=True):
    q, k, v = make_qkv(B, Hq, Nq, D, dtype, device, Hkv=Hkv, Nk=Nk)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", STAGE_NAMES)
def test_compile_fullgraph_traces_forward_and_backward(name, causal, device):
    """``fullgraph=True`` fails on any graph break: the whole step, attention's forward and backward
    included, is one graph. The compiled step equals the eager one (the same kernels run)."""
    attention = _attention(name)

    def step(q, k, v, do):
        o = attention(q, k, v, causal=causal)
        return (o * do).sum(), o

    q, k, v = _inputs(device)
    do = torch.randn(q.shape, device=device)
    counter = CompileCounterWithBackend("aot_eager")
    loss, o = torch.compile(step, backend=counter, fullgraph=True)(q, k, v, do)
    grads = torch.autograd.grad(loss, (q, k, v))
    assert counter.frame_count == 1
    eager_loss, eager_o = step(q, k, v, do)
    eager_grads = torch.autograd.grad(eager_loss, (q, k, v))
    torch.testing.assert_close(o, eager_o, rtol=0, atol=0)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    check_against_reference(o.detach(), q.detach(), k.detach(), v.detach(), causal=causal, dtype_name="fp32")


@pytest.mark.parametrize("name", STAGE_NAMES)
def test_the_traced_graph_holds_the_stage_s_ops(name, device):
    """What AOTAutograd traced: the stage's forward op in the forward graph, its backward op in the
    backward graph (not the Triton launches, which a tracer cannot follow)."""
    from torch._functorch.aot_autograd import aot_function

    graphs = []

    def keep(gm, _inputs):
        graphs.append(str(gm.graph))
        return gm

    fn = aot_function(lambda q, k, v: _attention(name)(q, k, v, causal=True).sum(), fw_compiler=keep,
                      bw_compiler=keep)
    q, k, v = _inputs(device)
    fn(q, k, v).backward()
    forward_graph, backward_graph = graphs
    assert f"attention_lab.{name}_forward" in forward_graph
    assert f"attention_lab.{name}_backward" in backward_graph


@pytest.mark.parametrize("name", STAGE_NAMES)
def test_a_growing_kv_cache_under_compile_recompiles_once(name, device):
    """Dynamo specializes on the first shapes it sees, then marks a changing size dynamic: a decode
    loop whose cache grows by a key per call compiles twice, not once per length. The op's fake
    implementation is what lets the dynamic graph be traced."""
    attention = _attention(name)
    counter = CompileCounterWithBackend("aot_eager")
    decode = torch.compile(lambda q, k, v: attention(q, k, v, causal=True), backend=counter, fullgraph=True)
    for nk in range(9, 15):
        q, k, v = _inputs(device, Nq=1, Nk=nk, grad=False)
        check_against_reference(decode(q, k, v), q, k, v, causal=True, dtype_name="fp32")
    assert counter.frame_count <= 2, f"{counter.frame_count} compilations for 6 cache lengths"


def _opcheck_cases(name, device):
    q, k, v = _inputs(device, grad=True)
    if name == "a":
        return [("a_forward", (q, k, v, True, 0.25))]
    if name == "b":
        return [("b_forward", (q, k, v, True, 0.25, True, "separate")),
                ("b_forward", (q, k, v, False, 0.25, True, "atomic"))]
    return [("c_forward", (q, k, v, True, 0.25, True, None, None, None, True, True, True, True, True, True, False)),
            ("c_forward", (q, k, v, False, 0.25, True, None, 2, None, True, True, True, True, True, True, True))]


@pytest.mark.parametrize("name", ["b", "c"])
def test_a_backward_without_the_saved_statistics_is_refused(name, device):
    """Called directly with ``store_lse=False``, the forward op keeps nothing to rebuild P from: its
    backward says so instead of reading an empty buffer."""
    q, k, v = _inputs(device)
    args = (q, k, v, True, 0.25, False) + (("separate",) if name == "b" else
                                           (None, None, None, True, True, True, True, True, True, False))
    o, _ = getattr(torch.ops.attention_lab, f"{name}_forward")(*args)
    with pytest.raises(RuntimeError, match="store_lse=True"):
        o.sum().backward()


@pytest.mark.parametrize("name", STAGE_NAMES)
def test_opcheck(name, device):
    """PyTorch's own check of a custom op: the schema, the fake implementation against the real one
    (shapes, dtypes, strides), the registered autograd, and tracing with dynamic shapes."""
    for op_name, args in _opcheck_cases(name, device):
        op = getattr(torch.ops.attention_lab, op_name).default
        torch.library.opcheck(op, args)


def _gradient_layouts(o: torch.Tensor) -> dict:
    """Upstream gradients of every layout a model can hand a backward."""
    base = torch.randn(o.shape, dtype=o.dtype, device=o.device)
    wide = torch.randn(*o.shape[:-1], 2 * o.shape[-1], dtype=o.dtype, device=o.device)
    return {
        "sum (expanded, every stride 0)": torch.ones((), dtype=o.dtype, device=o.device).expand(o.shape),
        "mean (expanded)": torch.full((), 1.0 / o.numel(), dtype=o.dtype, device=o.device).expand(o.shape),
        "transposed layout": base.transpose(1, 2).contiguous().transpose(1, 2),
        "head dim strided": wide[..., ::2],
        "broadcast over the batch": base[:1].expand(o.shape),
    }


@pytest.mark.parametrize("layout", ["sum (expanded, every stride 0)", "mean (expanded)", "transposed layout",
                                    "head dim strided", "broadcast over the batch"])
@pytest.mark.parametrize("name", STAGE_NAMES)
def test_any_gradient_layout_against_float64(name, layout, device):
    q, k, v = _inputs(device, grad=False)
    do = _gradient_layouts(torch.empty(q.shape, device=device))[layout]
    check_gradients(_attention(name), q, k, v, causal=True, dtype_name="fp32", do=do)


@pytest.mark.parametrize("name", STAGE_NAMES)
def test_sum_and_mean_backward(name, device):
    """The calls the issue of gradient layouts shows up in: ``.sum().backward()`` and ``.mean()``."""
    for reduce in (torch.sum, torch.mean):
        q, k, v = _inputs(device)
        reduce(_attention(name)(q, k, v, causal=True)).backward()
        assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_traced_tells_tracers_from_eager_calls():
    from torch._subclasses.fake_tensor import FakeTensorMode

    t = torch.randn(2, 2)
    assert not ops.traced(t, t)
    with FakeTensorMode() as mode:
        assert ops.traced(mode.from_tensor(t))
    assert ops.traced(torch.nn.Parameter(t))  # a subclass: the op handles it too
    # A dispatch mode records or intercepts ops on plain tensors (make_fx, FlopCounterMode); a
    # torch.func transform wraps them below autograd: the call must be the op in both.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Listening(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Listening():
        assert ops.traced(t)
    seen = []
    torch.vmap(lambda x: seen.append(ops.traced(x)) or x)(t)
    assert seen == [True]
    assert not ops.traced(t)


@pytest.mark.gpu
@pytest.mark.parametrize("name", STAGE_NAMES)
def test_gpu_inductor_and_cuda_graphs(name):
    """On the GPU: Inductor around the op (``mode="reduce-overhead"``: CUDA graphs of the forward and
    the backward), equal to eager, several steps in a row (graph replays)."""
    attention = _attention(name)

    def step(q, k, v):
        return attention(q, k, v, causal=True).float().square().mean()

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        q, k, v = _inputs("cuda", torch.bfloat16, B=2, Hq=8, Hkv=2, Nq=256, Nk=256, D=64)
        loss = compiled(q, k, v)
        grads = torch.autograd.grad(loss, (q, k, v))
        eager = torch.autograd.grad(step(q, k, v), (q, k, v))
        for g, e in zip(grads, eager):
            torch.testing.assert_close(g, e, rtol=2e-2, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("name", STAGE_NAMES)
def test_gpu_cuda_graph_capture_of_forward_and_backward(name):
    """A training step captured by hand into one CUDA graph (the eager path: no dispatcher, FastLaunch
    and Triton's launcher on the capture stream) and replayed on new data."""
    attention = _attention(name)
    q, k, v = _inputs("cuda", torch.float16, B=2, Hq=8, Hkv=4, Nq=200, Nk=300, D=64)
    do = torch.randn(q.shape, dtype=q.dtype, device="cuda")

    def step():
        for t in (q, k, v):
            t.grad = None
        attention(q, k, v, causal=True).backward(do)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: compilation and the kept kernels, outside the capture
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph_grads = [t.grad for t in (q, k, v)]  # the graph writes these at every replay
    for _ in range(2):
        with torch.no_grad():
            for t in (q, k, v, do):
                t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        captured = [g.clone() for g in graph_grads]
        step()
        # (stage C adds dQ with atomics, in an order that varies between runs: not bitwise)
        for c, t in zip(captured, (q, k, v)):
            torch.testing.assert_close(c, t.grad, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("name", STAGE_NAMES)
def test_eager_training_call_binds_no_signature(name, device, monkeypatch):
    """An eager call that autograd will differentiate goes through the stage's ``autograd.Function``;
    that Function must not make PyTorch bind the call's arguments to ``forward``'s signature on every
    call (``inspect.signature``, what a Function with a separate ``setup_context`` pays: tens of µs,
    once per layer per training step). Gradients still flow."""
    import inspect

    q, k, v = _inputs(device)
    _attention(name)(q, k, v, causal=True)  # the first call may compile (Triton binds its kernels' signatures once)
    calls = []
    real = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    o = _attention(name)(q, k, v, causal=True)
    assert calls == [], f"inspect.signature called {len(calls)} times by one eager call"
    dq, dk, dv = torch.autograd.grad(o.sum(), (q, k, v))
    assert dq.shape == q.shape and dk.shape == k.shape and torch.isfinite(dv).all()


@pytest.mark.parametrize("name", STAGE_NAMES)
def test_vmap_goes_through_the_op(name, device):
    """Under ``torch.vmap`` the tensors a stage sees are batched wrappers that its kernels cannot read:
    ``ops.traced`` counts the transform as tracing, so the call goes through the op, whose batching
    falls back to one call per entry. Each entry equals the stage called on it alone."""
    q, k, v = _inputs(device, grad=False)
    qs = torch.stack([q, q.flip(2)])
    attention = _attention(name)
    out = torch.vmap(lambda x: attention(x, k, v, causal=True))(qs)
    for i in range(2):
        torch.testing.assert_close(out[i], attention(qs[i], k, v, causal=True), rtol=0, atol=0)
