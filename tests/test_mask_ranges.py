"""A padding mask's key ranges (``stages/key_ranges.py``): the one-launch kernel and the tensor
operations a traced call takes, both against a plain Python reading of the definition, over masks
with left and right padding, holes, all-padding rows, masks shorter than the keys, an offset, several
dtypes and strides, causal and not, the filled length an int or a device tensor; and what a static
cache's step pays for its mask in operations."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

import stages  # noqa: F401  (first: it chooses the interpreter on a machine without a GPU)
from harness.op_count import DeviceOperations, key_ranges_launches
from stages import interpreted, key_ranges

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(rows: list[list[int]] | None, batch: int, q_length: int, kv_length: int, q_offset: int, kv_offset: int,
              causal: bool) -> tuple[list, list, list]:
    """The definition in ``stages/key_ranges.py``'s docstring, in Python: per sequence (start, stop),
    fits, whole."""
    end = q_offset + q_length - kv_offset
    ranges, fits, whole = [], [], []
    for b in range(batch):
        real = [rows is None or (kv_offset + j < len(rows[b]) and rows[b][kv_offset + j] != 0)
                for j in range(kv_length)]
        if causal:
            real = [r and j < end for j, r in enumerate(real)]
        keys = [j for j, r in enumerate(real) if r]
        start = keys[0] if keys else end
        stop = keys[-1] + 1 if keys else start
        fits.append(int(len(keys) == stop - start))
        if causal:
            stop = end
        ranges.append((start, stop))
        whole.append(int(start == 0 and stop == kv_length))
    return ranges, fits, whole


def random_rows(rng: random.Random, batch: int, tokens: int) -> list[list[int]]:
    """One row per sequence, each a different kind: left padding, right padding, both, a hole, all
    padding, all real, alternating."""
    kinds = ["left", "right", "both", "hole", "none", "all", "alternate"]
    rows = []
    for b in range(batch):
        kind = kinds[(b + rng.randrange(len(kinds))) % len(kinds)]
        a, z = sorted(rng.randrange(tokens + 1) for _ in range(2))
        row = {"left": [0] * a + [1] * (tokens - a), "right": [1] * a + [0] * (tokens - a),
               "both": [0] * a + [1] * (z - a) + [0] * (tokens - z), "none": [0] * tokens, "all": [1] * tokens,
               "alternate": [j % 2 for j in range(tokens)]}.get(kind)
        if row is None:  # a hole somewhere inside real tokens
            row = [1] * tokens
            row[rng.randrange(tokens)] = 0
        rows.append(row)
    return rows


def as_mask(rows, dtype: torch.dtype, strided: bool) -> torch.Tensor:
    t = torch.tensor(rows, dtype=torch.int64)
    if strided:  # every other column of a wider tensor, batch-major in reverse: neither stride is 1
        wide = torch.zeros(t.shape[1] * 2, t.shape[0], dtype=torch.int64)
        wide[::2] = t.t()
        t = wide.t()[:, ::2]
        assert t.stride(-1) != 1
    return t.to(device=DEVICE, dtype=dtype)


CASES = [  # (batch, tokens in the mask, kv_length, q_length, kv_offset)
    (1, 1, 1, 1, 0),                 # one key
    (3, 12, 12, 12, 0),              # a prefill
    (4, 13, 13, 1, 0),               # a decode step, dynamic cache
    (3, 12, 16, 1, 0),               # a static cache: 16 slots, a mask as long as the tokens so far
    (2, 20, 16, 1, 4),               # an offset (a window's cache): keys 4..19 of the mask
    (5, 1100, 1100, 1, 0),           # past one block of the kernel's walk
    (2, 700, 2100, 3, 0),            # a mask much shorter than the keys
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-T{}-K{}-Nq{}-off{}".format(*c))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("filled", ["int", "device"])
def test_kernel_and_tensor_operations_give_the_definition(case, causal, filled):
    batch, tokens, kv_length, q_length, kv_offset = case
    rng = random.Random(zlib.crc32(repr((case, causal, filled)).encode()))  # (a failure reproduces)
    for trial in range(3):
        rows = random_rows(rng, batch, tokens) if trial < 2 else None
        # The newest query's position: at the end of the mask, or (a static cache's prefill) earlier.
        q_offset = max(0, min(tokens, kv_offset + kv_length) - q_length - (rng.randrange(3) if trial == 1 else 0))
        want = reference(rows, batch, q_length, kv_length, q_offset, kv_offset, causal)
        offset = torch.tensor(q_offset, device=DEVICE) if filled == "device" else q_offset
        for dtype, strided in ((torch.int64, False), (torch.bool, True), (torch.float32, False)):
            mask = None if rows is None else as_mask(rows, dtype, strided)
            args = (mask, batch, q_length, kv_length, offset, kv_offset, causal, torch.device(DEVICE))
            for name, (ranges, flags) in (("kernel", key_ranges.key_ranges(*args)),
                                          ("tensor operations", key_ranges.key_ranges_torch(*args))):
                got = ([tuple(r) for r in ranges[:, 0, 0].tolist()], *flags.tolist())
                assert got == (want[0], want[1], want[2]), (name, trial, dtype, rows)
                assert ranges.dtype == torch.int32 and ranges.shape == (batch, 1, 1, 2)
                # The columns reach the attention kernels as [B] tensors without a copy.
                assert ranges[:, 0, 0, 0].is_contiguous() and ranges[:, 0, 0, 1].is_contiguous()


def test_the_kernel_runs_where_it_can():
    """Eager on the GPU (or the interpreter's CPU): the kernel; a tensor on another device, or a
    traced call: the tensor operations."""
    here = torch.device(DEVICE)
    assert key_ranges.kernel_can_run(here, torch.ones(2, 3, device=DEVICE), 7)
    assert not key_ranges.kernel_can_run(None)
    assert not key_ranges.kernel_can_run(torch.device("meta"), torch.ones(2, 3, device="meta"))
    if DEVICE == "cuda":
        assert not key_ranges.kernel_can_run(here, torch.ones(2, 3))  # a CPU mask for CUDA ranges
        assert not interpreted() and not key_ranges.kernel_can_run(torch.device("cpu"))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert not key_ranges.kernel_can_run(here, torch.ones(2, 3, device=DEVICE))


def test_a_static_cache_step_pays_one_launch_for_its_mask():
    """``generate`` with a static cache builds each step's mask eagerly, outside the compiled step:
    the key ranges are one kernel, an allocation, and the check that they fit (a reduction and the
    device-side assert): fewer operations than transformers' own SDPA mask for the same step, where
    the tensor operations were about 30."""
    pytest.importorskip("transformers", reason="transformers is the optional [hf] extra")
    from transformers.masking_utils import sdpa_mask

    from stages import hf

    ones = torch.ones(4, 140, dtype=torch.bool, device=DEVICE)
    filled = torch.tensor(139, device=DEVICE)
    args = dict(batch_size=4, q_length=1, kv_length=192, q_offset=filled, kv_offset=0, attention_mask=ones)
    with key_ranges_launches() as launched, DeviceOperations() as ops:
        hf.lab_mask(**args)
    mine = ops.names
    assert launched == [1] and sorted(mine) == ["_assert_async", "all", "empty"], mine
    with DeviceOperations() as theirs:
        sdpa_mask(**args, allow_is_causal_skip=False)
    with DeviceOperations() as torch_ops:  # the tensor operations, for scale
        key_ranges.key_ranges_torch(ones, 4, 1, 192, filled, 0, True, DEVICE)
    theirs, torch_ops = theirs.names, torch_ops.names
    assert len(mine) + len(launched) < len(theirs) < len(torch_ops), (mine, theirs, torch_ops)


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("causal,mask_dtype,filled_dtype", [(True, "bool", "int64"), (False, "int64", None),
                                                           (True, None, "int32")],
                         ids=["static-cache", "bidirectional-padding", "no-mask"])
def test_the_kernel_compiles_for_the_gpus(arch, causal, mask_dtype, filled_dtype):
    """Compiled as a GPU would (the interpreter forgives what the compiler refuses, such as a loop
    variable that changes type): one kernel, no local memory, the padding mask read only when there is one."""
    from stages.contract import Problem

    (kernel,) = key_ranges.compile(Problem(B=4, H=1, N=192, D=16), arch, causal=causal, mask_dtype=mask_dtype,
                                   filled_dtype=filled_dtype)
    ptx = kernel.asm["ptx"]
    assert ".local" not in ptx
    loads = ptx.count("ld.global")
    reads = (mask_dtype is not None) + (filled_dtype is not None)  # the mask, the filled length
    assert (loads >= reads if reads else loads == 0), loads
    assert ptx.count("st.global") >= 4  # start, stop, fits, whole
