"""Stage C with a key range per batch entry (``key_starts``/``key_lengths``): what a static KV cache
and a left-padded batch need. Sequence b attends to keys ``key_starts[b] <= j < key_lengths[b]``,
causal aligned to the range's end, so each batch entry must equal the plain contract run on its
slice of the keys: that is the reference (float64, through ``check_against_reference``), and a
batch entry whose range is empty must be all zeros. Every path that takes ranges (the ``tl``
kernel, the split-KV kernel and its merge) with odd sizes, GQA, Nq = 1 and Nq past the range,
ranges that start late, end early, are empty or point past the keys; the gradients (the ``tl``
backward kernels) the same way; the errors; no new plan or trace when the lengths change; the
custom op under ``torch.compile``; the compiled code.
"""

from __future__ import annotations

import pytest
import torch

from stages import interpreted
from stages.c_optimized import kernels
from stages.contract import Problem
from tests.helpers import check_against_reference, check_gradients, make_qkv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

#: path -> the stage C options that force it (None: the stage's own choice)
PATHS = {"tl": dict(split_kv=1), "split": dict(split_kv=3), "auto": {}}


def int32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def poison_outside(k, v, starts, lengths) -> None:
    """NaN in K and V before each sequence's range and from its end on: a kernel that read them would
    give NaN (P = 0 times NaN is NaN), where one that masks only the scores would not notice zeros."""
    for b, (first, end) in enumerate(zip(starts, lengths)):
        for t in (k, v):
            t[b, :, :first] = float("nan")
            t[b, :, end:] = float("nan")


def check_ranges(o, q, k, v, starts, lengths, *, causal, dtype_name, factor=2.0):
    """Each batch entry of ``o`` against the contract on its slice of the keys (the kernel's clamping
    applied: 0 <= start <= end <= Nk); an empty range gives zeros."""
    Nk = k.shape[2]
    for b in range(q.shape[0]):
        first = 0 if starts is None else min(max(int(starts[b]), 0), Nk)
        end = Nk if lengths is None else min(max(int(lengths[b]), first), Nk)
        if end == first:
            assert not o[b].any(), f"batch entry {b}: an empty key range must give zeros"
            continue
        check_against_reference(o[b:b + 1], q[b:b + 1], k[b:b + 1, :, first:end], v[b:b + 1, :, first:end],
                                causal=causal, dtype_name=dtype_name, factor=factor)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,starts,lengths", [
    (3, 4, 2, 1, 77, 64, [0, 3, 10], [77, 50, 60]),           # decode, GQA: late starts, early ends
    (2, 2, 1, 37, 90, 32, [5, 0], [90, 41]),                  # a prompt: Nq past the second range
    (3, 3, 3, 5, 130, 40, None, [1, 129, 64]),                 # lengths only; D padded to 64
    (2, 4, 4, 3, 33, 16, [33, 2], None),                       # starts only; an empty range (start = Nk)
    (2, 2, 2, 4, 50, 16, [-4, 20], [200, 20]),                 # out of range: clamped; start = end
])
def test_each_batch_entry_is_the_contract_on_its_range(path, causal, B, Hq, Hkv, Nq, Nk, D, starts, lengths):
    q, k, v = make_qkv(B, Hq, Nq, D, torch.float32, DEVICE, Hkv=Hkv, Nk=Nk)
    key_starts = None if starts is None else int32(starts)
    key_lengths = None if lengths is None else int32(lengths)
    o = kernels.attention(q, k, v, causal=causal, key_starts=key_starts, key_lengths=key_lengths, **PATHS[path])
    check_ranges(o, q, k, v, starts, lengths, causal=causal, dtype_name="fp32")


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("causal", [False, True])
def test_keys_outside_the_range_are_never_read(path, causal):
    """NaN in K and V before each range's start and from its end on (a static cache's unfilled slots,
    a reused buffer, may hold anything): the output must not see them. Reading them and masking the
    scores is not enough, since P = 0 times a NaN value is NaN."""
    q, k, v = make_qkv(3, 4, 5, 32, torch.float32, DEVICE, Hkv=2, Nk=200)
    starts, lengths = [0, 37, 5], [61, 200, 6]
    poison_outside(k, v, starts, lengths)
    o = kernels.attention(q, k, v, causal=causal, key_starts=int32(starts), key_lengths=int32(lengths),
                          **PATHS[path])
    check_ranges(o, q, k, v, starts, lengths, causal=causal, dtype_name="fp32")


@pytest.mark.parametrize("dtype_name", ["fp16", "bf16"])
@pytest.mark.parametrize("path", ["tl", "split"])
def test_half_precision_and_huge_logits(dtype_name, path):
    """fp16/bf16 inputs scaled by 20: logits in the hundreds, where a range's masked keys must still
    count for nothing (a -inf that leaked would make NaN or shift the row's maximum)."""
    q, k, v = make_qkv(2, 4, 6, 64, DTYPES[dtype_name], DEVICE, Hkv=2, Nk=70, scale=20 ** 0.5)
    starts, lengths = [7, 0], [70, 31]
    o = kernels.attention(q, k, v, causal=True, key_starts=int32(starts), key_lengths=int32(lengths), **PATHS[path])
    check_ranges(o, q, k, v, starts, lengths, causal=True, dtype_name=dtype_name)


def test_a_static_cache_loop_reuses_one_plan():
    """A static cache: the same K/V tensors every step, one more slot filled each time. The lengths
    are device data, so every step is one layout: one plan, kept, and each step right."""
    q, k, v = make_qkv(2, 4, 1, 32, torch.float32, DEVICE, Hkv=2, Nk=96)
    lengths = int32([0, 0])
    kernels._LAYOUT_PLANS.clear()
    for n in range(40, 46):
        lengths.fill_(n)
        o = kernels.attention(q, k, v, causal=True, key_lengths=lengths)
        check_ranges(o, q, k, v, None, [n, n], causal=True, dtype_name="fp32")
    assert len(kernels._LAYOUT_PLANS) == 1


def test_no_range_and_full_ranges_agree():
    """Ranges covering every key compute what the call without them does (same kernel family, so
    the outputs agree to rounding)."""
    q, k, v = make_qkv(2, 2, 9, 32, torch.float32, DEVICE, Nk=40)
    plain = kernels.attention(q, k, v, causal=True, split_kv=1)
    ranged = kernels.attention(q, k, v, causal=True, split_kv=1, key_starts=int32([0, 0]), key_lengths=int32([40, 40]))
    torch.testing.assert_close(ranged, plain, rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------------------------------------- the errors

def test_bad_key_ranges_are_named():
    q, k, v = make_qkv(3, 2, 1, 16, torch.float32, DEVICE, Nk=10)
    with pytest.raises(TypeError, match=r"key_lengths must be an int32 tensor of shape \[B\] = \[3\], got dtype "
                                        r"int64; convert it"):
        kernels.attention(q, k, v, key_lengths=torch.tensor([1, 2, 3], device=DEVICE))
    with pytest.raises(ValueError, match=r"key_starts must have shape \[B\] = \[3\].*got \(2,\)"):
        kernels.attention(q, k, v, key_starts=int32([1, 2]))
    with pytest.raises(TypeError, match=r"key_lengths must be None or an int32 tensor.*got list"):
        kernels.attention(q, k, v, key_lengths=[1, 2, 3])


def embedded(first: int, end: int, Nk: int, **options):
    """Stage C with a key range, as a function of only the range's keys: they are placed at
    [first, end) of Nk keys whose others are NaN, so ``check_gradients`` holds the call to the
    contract on those keys alone (and any read outside the range would show as NaN)."""
    def attention(q, k, v, *, causal, sm_scale=None):
        def outside(n):
            return torch.full((k.shape[0], k.shape[1], n, k.shape[3]), float("nan"), dtype=k.dtype, device=k.device)
        kf = torch.cat([outside(first), k, outside(Nk - end)], dim=2)
        vf = torch.cat([outside(first), v, outside(Nk - end)], dim=2)
        B = q.shape[0]  # (every batch entry the same range)
        return kernels.attention(q, kf, vf, causal=causal, sm_scale=sm_scale, key_starts=int32([first] * B),
                                 key_lengths=int32([end] * B), **options)
    return attention


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "dq-kernel"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("first,end,Nq,Nk", [(3, 40, 9, 50), (0, 17, 20, 64), (10, 11, 1, 30), (5, 70, 70, 70)])
def test_gradients_on_the_range_are_the_contract_s(deterministic, causal, first, end, Nq, Nk):
    """The backward with a key range: dQ, and dK and dV of the range's keys, equal float64 autograd on
    those keys alone (within check_gradients' bounds), with GQA, Nq past the range, one key, and
    the atomic-dQ and dQ-kernel plans."""
    q, k, v = make_qkv(1, 4, Nq, 16, torch.float32, DEVICE, Hkv=2, Nk=end - first)
    check_gradients(embedded(first, end, Nk, deterministic=deterministic), q, k, v, causal=causal,
                    dtype_name="fp32")


@pytest.mark.parametrize("dtype_name", ["fp16", "bf16"])
def test_half_precision_gradients_on_a_range(dtype_name):
    q, k, v = make_qkv(1, 4, 24, 32, DTYPES[dtype_name], DEVICE, Hkv=2, Nk=37)
    check_gradients(embedded(6, 43, 60), q, k, v, causal=True, dtype_name=dtype_name)


def test_keys_outside_the_ranges_get_zero_gradients():
    """A batch whose sequences have different ranges: the gradients of the keys and values outside
    each sequence's range are exactly zero, and the rest finite."""
    q, k, v = make_qkv(3, 4, 6, 16, torch.float32, DEVICE, Hkv=2, Nk=40)
    starts, lengths = [0, 9, 39], [40, 25, 39]
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    kernels.attention(q, k, v, causal=True, key_starts=int32(starts), key_lengths=int32(lengths)).sum().backward()
    for b, (first, end) in enumerate(zip(starts, lengths)):
        for g in (k.grad[b], v.grad[b]):
            assert not g[:, :first].any() and not g[:, end:].any()
            assert torch.isfinite(g).all()
    assert not q.grad[2].any()  # (an empty range: the sequence's output is 0, whatever q)


def test_key_ranges_refuse_the_warp_specialized_kernel():
    from stages.c_optimized.configs import ws_shapes

    ws = ws_shapes(64)[0]
    for asked in (dict(ws_rung=1), dict(config=ws)):
        with pytest.raises(ValueError, match="key_starts/key_lengths run on the tl and split-KV kernels"):
            kernels.select(1, 2, 2, 4096, 4096, 64, torch.float16, True, 90, 132, key_range=True, **asked)
    assert kernels.select(1, 2, 2, 4096, 4096, 64, torch.float16, True, 90, 132, config=ws).path == "ws"
    for D in (64, 128, 80, 256):
        for Nq in (1, 7, 4096):
            assert kernels.select(1, 32, 8, Nq, 4096, D, torch.bfloat16, True, 90, 132,
                                  key_range=True).path in ("tl", "split")


# ----------------------------------------------------------------------------------- traced and compiled

def test_compiled_call_takes_the_ranges_as_data():
    """``torch.compile(fullgraph=True)`` of a call with key ranges: one graph for every length (they
    are tensors), equal to eager."""
    torch._dynamo.reset()
    q, k, v = make_qkv(2, 4, 1, 32, torch.float32, DEVICE, Hkv=2, Nk=64)
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm

    @torch.compile(backend=backend, fullgraph=True)
    def step(q, k, v, lengths):
        return kernels.attention(q, k, v, causal=True, key_lengths=lengths)

    for n in (10, 33, 64):
        lengths = int32([n, n - 5])
        torch.testing.assert_close(step(q, k, v, lengths), kernels.attention(q, k, v, causal=True, key_lengths=lengths))
    assert len(frames) == 1
    assert any(node.target is torch.ops.attention_lab.c_forward.default for node in frames[0].graph.nodes)


def test_compiled_training_step_with_ranges_equals_eager():
    """Forward and backward traced with ``aot_eager`` (the custom ops carry the ranges into the
    backward graph): the same gradients as eager."""
    torch._dynamo.reset()
    q, k, v = make_qkv(2, 4, 7, 16, torch.float32, DEVICE, Hkv=2, Nk=30)
    starts, lengths = int32([2, 0]), int32([30, 19])

    def step(q, k, v):
        return kernels.attention(q, k, v, causal=True, key_starts=starts, key_lengths=lengths).square().sum()

    grads = {}
    for name, fn in (("eager", step), ("compiled", torch.compile(step, backend="aot_eager", fullgraph=True))):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        fn(*leaves).backward()
        grads[name] = [t.grad for t in leaves]
    for a, b in zip(grads["compiled"], grads["eager"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not interpreted() and not torch.cuda.is_available(), reason="needs the interpreter or a GPU")
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("N,Nk", [(1, 4096), (300, 4096)])
def test_ranged_kernels_compile_without_spills(arch, N, Nk):
    """The ranged variants compile for sm_80 and sm_90 (no GPU needed), read the two range values,
    and do not spill."""
    from harness.inspect_code import run_ptxas

    p = Problem(B=4, H=16, Hkv=4, N=N, Nk=Nk, D=128, causal=True, dtype="bf16")
    ranged = kernels.compile(p, arch, key_ranges=True)
    plain = kernels.compile(p, arch)
    assert [c.name for c in ranged] == [c.name for c in plain]
    # the two int32 [B] arguments (the plain kernel has them compiled out as None)
    assert ranged[0].asm["ttir"].count("!tt.ptr<i32>") >= 2 > plain[0].asm["ttir"].count("!tt.ptr<i32>")
    for c in ranged:
        usage = run_ptxas(c.asm["ptx"], f"sm_{arch}a" if arch == 90 else f"sm_{arch}")
        assert usage["spill_stores"] == usage["spill_loads"] == 0, (c.name, usage)


@pytest.mark.skipif(not interpreted() and not torch.cuda.is_available(), reason="needs the interpreter or a GPU")
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("deterministic", [False, True])
def test_ranged_backward_kernels_compile(arch, deterministic):
    """The backward's ranged variants (the tl dK/dV and dQ kernels, on Hopper too) compile, assemble,
    and read the two range values. (At D 128 the tl dK/dV kernel spills with ranges or without: 64-116
    bytes per thread ranged, 64-924 not, on these problems; the dQ kernel does not.)"""
    from harness.inspect_code import run_ptxas
    from stages.c_optimized import backward as bwd

    p = Problem(B=4, H=16, Hkv=4, N=1024, D=128, causal=True, dtype="bf16")
    kernels_ = bwd.compile_backward(p, arch, key_ranges=True, deterministic=deterministic)
    names = [c.name for c in kernels_]
    assert "attention_bwd_dkdv_kernel" in names and ("attention_bwd_dq_kernel" in names) == deterministic
    for c in kernels_:
        if c.name == "attention_bwd_delta_kernel":
            continue
        assert c.asm["ttir"].count("!tt.ptr<i32>") >= 2, c.name
        usage = run_ptxas(c.asm["ptx"], f"sm_{arch}a" if arch == 90 else f"sm_{arch}")
        assert "ptxas_error" not in usage, usage
        if c.name == "attention_bwd_dq_kernel":
            assert usage["spill_stores"] == usage["spill_loads"] == 0, (c.name, usage)


@pytest.mark.gpu
@pytest.mark.parametrize("path", list(PATHS))
def test_gpu_key_ranges(path):
    """On the GPU (the lean and bound launches; a ranged call loads K and V by pointers, not TMA):
    ranges in bf16, GQA, decode and a prompt, NaN outside the ranges, three calls so the bound
    launch runs too."""
    for Nq in (1, 130):
        q, k, v = make_qkv(3, 8, Nq, 128, torch.bfloat16, "cuda", Hkv=2, Nk=1000)
        starts, lengths = [0, 17, 999], [1000, 515, 999]
        poison_outside(k, v, starts, lengths)
        for _ in range(3):
            o = kernels.attention(q, k, v, causal=True, key_starts=int32(starts), key_lengths=int32(lengths),
                                  **PATHS[path])
        check_ranges(o, q, k, v, starts, lengths, causal=True, dtype_name="bf16")


def test_the_splits_share_out_the_range_not_the_cache():
    """A static cache far longer than its filled range: the split kernel divides the range among its
    splits (chunks of Nk would leave the first split all the work and the rest none). Read from
    the splits' partial log-sum-exps: finite wherever a split found keys."""
    q, k, v = make_qkv(2, 4, 1, 32, torch.float32, DEVICE, Hkv=2, Nk=2048)
    lengths = int32([300, 2048])
    o = torch.empty_like(q)
    launches = kernels.plan(q, k, v, o, causal=True, scale=32 ** -0.5, arch=90, split_kv=4, key_lengths=lengths)
    first = launches[0]
    first.run()
    lse_part = first.args["LSE_PART"].view(4, 2, 4)  # [splits, batch, query heads]
    # 300 keys in whole 64-key tiles over 4 splits: chunks of 128, three splits with keys (chunks of
    # Nk, 512 keys each, would give the first split all 300 and the others none).
    assert torch.isfinite(lse_part[:, 0]).all(dim=1).tolist() == [True, True, True, False]
    assert torch.isfinite(lse_part[:, 1]).all()
    for launch in launches[1:]:
        launch.run()
    check_ranges(o, q, k, v, None, [300, 2048], causal=True, dtype_name="fp32")


@pytest.mark.gpu
def test_gpu_a_captured_decode_step_follows_its_lengths():
    """What a static cache's compiled decode step does: one ranged call captured in a CUDA graph, then
    replayed after the cache (K, V) and the lengths changed in place. Each replay attends to the
    lengths of that moment, and never reads past them."""
    q, k, v = make_qkv(2, 16, 1, 128, torch.bfloat16, "cuda", Hkv=4, Nk=2048)
    lengths = int32([100, 7])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(2):  # warm-up outside the capture: compilation, the kept and bound launches
            kernels.attention(q, k, v, causal=True, key_lengths=lengths)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = kernels.attention(q, k, v, causal=True, key_lengths=lengths)
    for n0, n1 in [(101, 8), (1500, 2048), (1, 1)]:
        with torch.no_grad():
            for t in (q, k, v):
                t.copy_(torch.randn_like(t))
            poison_outside(k, v, [0, 0], [n0, n1])
        lengths.copy_(int32([n0, n1]))
        graph.replay()
        torch.cuda.synchronize()
        check_ranges(out, q, k, v, None, [n0, n1], causal=True, dtype_name="bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_gradients_on_a_range(causal):
    """On the GPU (the tl backward kernels, which a ranged call takes on Hopper too): bf16, GQA, a range
    in the middle of a longer cache whose other keys are NaN."""
    q, k, v = make_qkv(2, 8, 300, 128, torch.bfloat16, "cuda", Hkv=2, Nk=700)
    check_gradients(embedded(100, 800, 1000), q, k, v, causal=causal, dtype_name="bf16")
