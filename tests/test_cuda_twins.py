"""Tests of the CUDA C++ twins (``b_cuda``, ``c_cuda``).

Without a GPU (CI): the ``.cu`` files compile with the machine's ``nvcc`` for sm_80 and sm_90a;
ptxas' resource report shows no spills; the PTX and SASS contain the mechanisms each stage claims
(C: cp.async / LDGSTS, ldmatrix / LDSM, mma.sync / HMMA; B: none of them); the shared-library
build path the wrappers use works; registration, input checks and the traffic models.
Each file is compiled once per session (module-scoped fixtures): a few seconds each.

With a GPU (``pytest -m gpu tests/test_cuda_twins.py``): numerics against a float64 reference for
fp16/bf16, D in {64, 128}, ragged N, causal or not, every shared-memory layout, strided inputs,
poisoned outputs.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import stages
from stages import contract
from stages.b_tiled import cuda_twin as b_twin
from stages.c_optimized import cuda_twin as c_twin
from stages.contract import Problem

NVCC = b_twin.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME or put nvcc on PATH)")

#: GPU tests: marked ``gpu`` (tests/conftest.py skips them without CUDA) and skipped here as well,
#: so this file is safe to run alone.
def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))

ARCHS = {"sm_80": "-gencode=arch=compute_80,code=sm_80", "sm_90a": "-gencode=arch=compute_90a,code=sm_90a"}


def _cuobjdump() -> str | None:
    if NVCC is not None and (Path(NVCC).parent / "cuobjdump").is_file():
        return str(Path(NVCC).parent / "cuobjdump")
    try:
        import triton

        p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if p.is_file():
            return str(p)
    except ImportError:
        pass
    return shutil.which("cuobjdump")


def _compile(source: Path, arch: str, out_dir: Path) -> dict:
    """nvcc -cubin (with ptxas -v) and -ptx for one arch; return the report, PTX and SASS text."""
    cubin = out_dir / f"{source.stem}-{arch}.cubin"
    ptx = out_dir / f"{source.stem}-{arch}.ptx"
    flags = ["-O3", "-std=c++17", ARCHS[arch]]
    proc = subprocess.run([NVCC, *flags, "-cubin", "-Xptxas", "-v", str(source), "-o", str(cubin)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    proc_ptx = subprocess.run([NVCC, *flags, "-ptx", str(source), "-o", str(ptx)], capture_output=True, text=True)
    assert proc_ptx.returncode == 0, proc_ptx.stderr
    sass = None
    tool = _cuobjdump()
    if tool is not None:
        res = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True)
        sass = res.stdout if res.returncode == 0 else None
    return {"report": proc.stderr, "ptx": ptx.read_text(), "sass": sass}


def parse_ptxas(report: str) -> dict[str, dict]:
    """ptxas -v output -> {kernel (mangled): {"registers", "spill_stores", "spill_loads", "smem"}} (bytes)."""
    kernels: dict[str, dict] = {}
    current = None
    for line in report.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = kernels.setdefault(m.group(1), {"registers": 0, "spill_stores": 0, "spill_loads": 0, "smem": 0})
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            current["spill_stores"], current["spill_loads"] = int(m.group(1)), int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["registers"] = int(m.group(1))
        m = re.search(r"(\d+) bytes smem", line)
        if m:
            current["smem"] = int(m.group(1))
    return kernels


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    out = tmp_path_factory.mktemp("cuda_twins")
    return {(stage, arch): _compile(src, arch, out)
            for stage, src in (("b", b_twin.SOURCE), ("c", c_twin.SOURCE)) for arch in ARCHS}


# ---------------------------------------------------------------------------------------------
# compiled code (no GPU)

@needs_nvcc
@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("stage", ["b", "c"])
def test_compiles_without_spills(compiled, stage, arch):
    kernels = parse_ptxas(compiled[(stage, arch)]["report"])
    expected = 8 if stage == "b" else 12  # b: 2 dtypes x 2 D x 2 layouts; c: x 3 layouts
    assert len(kernels) == expected, kernels
    for name, res in kernels.items():
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0, (name, res)
        assert 0 < res["registers"] <= 255, (name, res)


@needs_nvcc
@pytest.mark.parametrize("arch", list(ARCHS))
def test_ptx_shows_the_mechanisms(compiled, arch):
    c_ptx, b_ptx = compiled[("c", arch)]["ptx"], compiled[("b", arch)]["ptx"]
    for needle in ("cp.async.cg.shared.global", "cp.async.commit_group", "cp.async.wait_group 1",
                   "ldmatrix.sync.aligned.m8n8.x4.shared.b16", "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                   "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                   "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "ex2.approx"):
        assert needle in c_ptx, needle
    for needle in ("cp.async", "ldmatrix", "mma.sync"):
        assert needle not in b_ptx, needle
    assert "bar.sync" in b_ptx or "barrier.sync" in b_ptx


@needs_nvcc
@pytest.mark.parametrize("arch", list(ARCHS))
def test_sass_shows_the_mechanisms(compiled, arch):
    c_sass, b_sass = compiled[("c", arch)]["sass"], compiled[("b", arch)]["sass"]
    if c_sass is None or b_sass is None:
        pytest.skip("no cuobjdump (neither beside nvcc nor in the triton package)")
    for needle in ("LDGSTS", "LDSM.16.M88.4", "LDSM.16.MT88.4", "HMMA.16816.F32", "BAR.SYNC", "DEPBAR"):
        assert needle in c_sass, needle
    for needle in ("LDGSTS", "LDSM", "HMMA"):
        assert needle not in b_sass, needle
    assert "BAR.SYNC" in b_sass and "LDG" in b_sass and "STS" in b_sass


@needs_nvcc
def test_shared_library_build_path(tmp_path, monkeypatch):
    """The wrappers' own build: nvcc -shared for sm_80, cached by content hash, loadable by ctypes."""
    import ctypes

    monkeypatch.setenv("ATTN_LAB_CUDA_BUILD_DIR", str(tmp_path))
    path = b_twin.build_library(b_twin.SOURCE, (8, 0), "b_cuda")
    assert path.is_file() and path.parent == tmp_path
    assert b_twin.build_library(b_twin.SOURCE, (8, 0), "b_cuda") == path  # cached
    lib = ctypes.CDLL(str(path))  # dlopen needs no GPU
    assert hasattr(lib, "flash_b_forward")


# ---------------------------------------------------------------------------------------------
# registry, input checks, models (no GPU)

def test_registered():
    for name, mod in (("b_cuda", b_twin), ("c_cuda", c_twin)):
        stage = stages.get_stage(name)
        assert stage is mod.STAGE and stage.requires_cuda
        assert stage.kernel_names and stage.techniques
    assert stages.get_stage("b_cuda").variants == {"padded": {"smem_pad": True}}
    assert set(stages.get_stage("c_cuda").variants) == {"unpadded", "swizzled"}


def test_gencode_choice():
    assert b_twin.gencode_flags((9, 0)) == ["-gencode=arch=compute_90a,code=sm_90a"]
    assert "-gencode=arch=compute_80,code=sm_80" in b_twin.gencode_flags((8, 6))
    with pytest.raises(RuntimeError, match="8.0"):
        b_twin.gencode_flags((7, 5))


@pytest.mark.parametrize("mod", [b_twin, c_twin])
def test_bad_input_is_a_clear_error(mod):
    q = torch.zeros(1, 1, 8, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="head dim"):
        mod.attention(q, q, q)
    q = torch.zeros(1, 1, 8, 64, dtype=torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        mod.attention(q, q, q)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
@pytest.mark.parametrize("mod,name", [(b_twin, "b_cuda"), (c_twin, "c_cuda")])
def test_no_gpu_is_a_clear_error(mod, name):
    q = torch.zeros(1, 1, 8, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=f"stage {name} needs a CUDA GPU and nvcc"):
        mod.attention(q, q, q)


def test_traffic_models():
    e, D = 2, 64
    p = Problem(2, 3, 100, D)  # 4 query tiles of 32 (B), 2 of 64 (C)
    heads, N = 6, 100
    assert b_twin.hbm_bytes(p).read == heads * (N * D * e + 2 * 4 * N * D * e)
    assert b_twin.hbm_bytes(p).write == heads * N * D * e
    assert b_twin.hbm_bytes(Problem(2, 3, 100, D, causal=True)) == b_twin.hbm_bytes(p)  # B skips nothing
    assert c_twin.hbm_bytes(p).read == heads * (N * D * e + 2 * 2 * N * D * e)
    # causal C: query tile 0 reads 64 K/V rows, tile 1 reads 100
    assert c_twin.hbm_bytes(Problem(2, 3, 100, D, causal=True)).read == heads * (N * D * e + 2 * (64 + 100) * D * e)
    assert b_twin.workspace_bytes(p) == 0 and c_twin.workspace_bytes(p) == 0


# ---------------------------------------------------------------------------------------------
# numerics (GPU)

def _reference(q, k, v, causal, scale, dtype):
    """(float64 result, the same formula evaluated by PyTorch in ``dtype``)."""
    N = q.shape[2]
    mask = torch.zeros(N, N, device=q.device)
    if causal:
        mask = torch.full((N, N), float("-inf"), device=q.device).triu(1)
    outs = []
    for dt in (torch.float64, dtype):
        qq, kk, vv = (t.to(dt) for t in (q, k, v))
        s = (qq @ kk.transpose(-1, -2)) * scale + mask.to(dt)
        outs.append(torch.softmax(s, dim=-1) @ vv)
    return outs


def _rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


LAYOUTS = [("b_cuda", {}), ("b_cuda", {"smem_pad": True}), ("c_cuda", {}), ("c_cuda", {"smem_pad": False}),
           ("c_cuda", {"smem_pad": False, "swizzle": True})]


@gpu
@pytest.mark.parametrize("stage,kwargs", LAYOUTS, ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_reference(stage, kwargs, dtype, D, causal, monkeypatch):
    monkeypatch.setattr(contract, "poison_outputs", True)
    attention = stages.get_stage(stage).attention
    gen = torch.Generator(device="cuda").manual_seed(0)
    for N in (1, 17, 64, 100, 257, 1000):
        B, H = 2, 3
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
        scale = 1.0 / math.sqrt(D)
        o = attention(q, k, v, causal=causal, **kwargs)
        torch.cuda.synchronize()
        assert o.shape == q.shape and o.dtype == dtype
        assert torch.isfinite(o).all(), f"N={N}: non-finite output (unwritten or NaN)"
        ref, same_precision = _reference(q, k, v, causal, scale, dtype)
        err, err_torch = _rel_err(o, ref), _rel_err(same_precision, ref)
        assert err <= 2 * err_torch + 1e-3, f"N={N}: rel err {err:.2e} vs torch {err_torch:.2e}"


@gpu
@pytest.mark.parametrize("stage,kwargs", LAYOUTS, ids=lambda x: str(x))
def test_strided_inputs_and_scale(stage, kwargs, monkeypatch):
    """[B, N, H, D] tensors transposed to [B, H, N, D] (no copy), and a non-default sm_scale."""
    monkeypatch.setattr(contract, "poison_outputs", True)
    attention = stages.get_stage(stage).attention
    gen = torch.Generator(device="cuda").manual_seed(1)
    B, H, N, D, dtype = 2, 3, 300, 128, torch.float16
    q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=dtype, generator=gen).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    for causal in (False, True):
        o = attention(q, k, v, causal=causal, sm_scale=0.05, **kwargs)
        ref, same_precision = _reference(q, k, v, causal, 0.05, dtype)
        assert _rel_err(o, ref) <= 2 * _rel_err(same_precision, ref) + 1e-3


@gpu
def test_heads_are_independent():
    """Each (batch, head) must see only its own K/V: make one head's values huge and check the others."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(2, 3, 130, 64, device="cuda", dtype=torch.float16, generator=gen) for _ in range(3))
    v2 = v.clone()
    v2[1, 2] += 100.0
    for name in ("b_cuda", "c_cuda"):
        attention = stages.get_stage(name).attention
        o1, o2 = attention(q, k, v), attention(q, k, v2)
        changed = (o1 - o2).abs().amax(dim=(-1, -2))
        assert changed[1, 2] > 50 and changed.flatten()[:-1].max() == 0, (name, changed)
