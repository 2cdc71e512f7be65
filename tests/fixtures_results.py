"""A small synthetic results directory, written through the real schema (``RowWriter``, ``write_env``).

The numbers are invented but shaped like an H200 sweep (FA-paper setting: B·N = 16k tokens,
H·D = 2048): stage A slow and O(N²) in bytes and memory, B and C O(N) in memory, SDPA peers,
stage C's ablation at the headline cell, an OOM row, an unsupported row, Nsight-measured DRAM
bytes on part of the rows, energy on the headline cells. Tests that need results on disk use
:func:`build_results`; nothing here imports the stages or needs a GPU.
"""

from __future__ import annotations

from pathlib import Path

from harness.results import RowWriter, write_env

NS = (512, 1024, 2048, 4096, 8192, 16384)
DS = (64, 128)
#: invented saturating throughput per impl (TFLOPS at large N, non-causal)
PEAK_TFLOPS = {"a": 45.0, "b": 210.0, "c": 380.0, "sdpa_flash": 300.0, "sdpa_cudnn": 470.0,
               "sdpa_efficient": 130.0, "sdpa_math": 35.0}
#: stage C's cumulative ablation steps (names as stages/c_optimized registers them) and invented gains
ABLATION = (("+none", 0.97), ("+tuned_tiles", 1.10), ("+pipelining", 1.35), ("+tma", 1.08), ("+exp2", 1.06),
            ("+causal_skip", 1.0))
TOTAL_MEMORY = 150_000_000_000  # bytes, about an H200


def _shape(N: int, D: int) -> tuple[int, int]:
    return max(1, 16384 // N), 2048 // D


def _row(impl: str, kind: str, N: int, D: int, causal: int, *, tflops: float, variant: str = "",
         measured: bool = False, energy: bool = False, status: str = "ok") -> dict:
    B, H = _shape(N, D)
    e = 2  # fp16 bytes
    flops = 4.0 * B * H * N * N * D / (2 if causal else 1)
    qkvo = 4 * B * H * N * D * e
    stage = impl in ("a", "b", "c")
    if impl == "a":
        sp = B * H * N * N * e
        read, write = qkvo * 3 // 4 + 2 * sp, qkvo // 4 + 2 * sp
        workspace = 2 * sp + qkvo // 4
    else:
        br = 64 if impl == "b" else 128  # C's bigger query tile re-reads K and V half as often
        read, write = B * H * N * D * e * (1 + 2 * max(1, N // br)), qkvo // 4
        workspace = qkvo // 4 + B * H * N * 8
    row = {"run_id": "2026-11-29T10:00:00Z", "impl": impl, "kind": kind, "variant": variant,
           "B": B, "H": H, "N": N, "D": D, "dtype": "fp16", "causal": causal, "device": "gpu",
           "status": status}
    if status != "ok":
        if stage:
            row.update(dram_read_model=read, dram_write_model=write, peak_mem_model=workspace)
        return row
    ms = flops / (tflops * 1e12) * 1e3
    row.update(ms_median=ms, ms_p20=ms * 0.98, ms_p80=ms * 1.03, tflops=tflops,
               rel_err=3e-4 if impl != "sdpa_math" else 2e-4, torch_rel_err=2.5e-4,
               peak_mem_measured=int((workspace if stage else qkvo // 4 + B * H * N * 4) * 1.02))
    if stage:
        row.update(dram_read_model=read, dram_write_model=write, peak_mem_model=workspace,
                   gbps_model=(read + write) / (ms * 1e-3) / 1e9)
    if measured:
        # L2 catches part of the K/V re-reads, so measured < model for the tiled stages
        frac = 0.95 if impl == "a" else 0.55
        row.update(dram_read_measured=int(read * frac), dram_write_measured=int(write * 0.97),
                   l2_hit_rate_pct=60.0)
    if energy:
        power = 640.0 if impl != "sdpa_math" else 450.0
        row.update(energy_j_per_call=power * ms * 1e-3, power_w=power, sm_clock_mhz=1980.0,
                   mem_clock_mhz=3201.0, temp_c=54.0)
    return row


def _tflops(impl: str, N: int, D: int, causal: int) -> float:
    fill = N / (N + 1024)  # short sequences under-fill the GPU
    t = PEAK_TFLOPS[impl] * fill * (1.15 if D == 128 else 1.0)
    return t * (0.8 if causal and impl != "a" else 0.3 if causal else 1.0)


def build_rows() -> list[dict]:
    rows = []
    for D in DS:
        for causal in (0, 1):
            for N in NS:
                headline = N == 4096
                for impl in ("a", "b", "c"):
                    if impl == "a" and N == 16384 and D == 64:
                        rows.append(_row(impl, "stage", N, D, causal, tflops=0, status="oom"))
                        continue
                    rows.append(_row(impl, "stage", N, D, causal, tflops=_tflops(impl, N, D, causal),
                                     measured=(causal == 0 and N <= 8192) or headline, energy=headline))
                for impl in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math"):
                    if impl == "sdpa_math" and N >= 8192:
                        continue  # the math backend is too slow to sweep long sequences
                    rows.append(_row(impl, "peer", N, D, causal, tflops=_tflops(impl, N, D, causal),
                                     measured=headline and causal == 0, energy=headline))
    # stage C's ablation at the headline cell: cumulative "+" steps from B's settings, then leave-one-out
    b = _tflops("b", 4096, 64, 0)
    t = b
    for name, gain in ABLATION:
        t *= gain
        rows.append(_row("c", "ablation", 4096, 64, 0, tflops=t, variant=name, measured=True))
    rows.append(_row("c", "ablation", 4096, 64, 0, tflops=t, variant="all", measured=True))
    for name, gain in ABLATION[1:]:
        rows.append(_row("c", "ablation", 4096, 64, 0, tflops=t / gain, variant="-" + name[1:]))
    rows.append(_row("sdpa_flash", "peer", 4096, 64, 0, tflops=0, status="unsupported: fp32 not supported")
                | {"dtype": "fp32"})
    return rows


def build_results(out_dir, *, ceilings: bool = True, total_memory: bool = True, rows=None) -> Path:
    """Write ``runs.csv`` + ``env.json`` into ``out_dir``; returns ``out_dir`` as a Path.

    ``env.json`` uses the keys the harness writes (``device_info.gpu_env``'s ``memory_bytes``,
    ``ceilings.measure_ceilings`` under ``"ceilings"``); ``ceilings``/``total_memory`` leave them out."""
    out_dir = Path(out_dir)
    with RowWriter(out_dir) as w:
        for row in build_rows() if rows is None else rows:
            w.write(row)
    env = {"run_id": "2026-11-29T10:00:00Z", "date": "2026-11-29T10:00:00Z", "command": "harness sweep",
           "git_commit": "abc1234", "gpu_name": "NVIDIA H200"}
    if ceilings:
        env["ceilings"] = {"copy_gbps": 4300.0, "matmul_fp16_tflops": 740.0, "matmul_bf16_tflops": 735.0}
    if total_memory:
        env["memory_bytes"] = TOTAL_MEMORY
    write_env(out_dir, env)
    return out_dir
