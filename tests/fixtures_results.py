"""A small synthetic results directory, written through the real schema (``RowWriter``, ``write_env``).

The numbers are invented but shaped like an H200 sweep (FA-paper setting: B·N = 16k tokens,
H·D = 2048): stage A slow and O(N²) in bytes and memory, B and C O(N) in memory, SDPA peers,
stage C's ablation at the headline cell, an OOM row, an unsupported row, Nsight-measured DRAM
bytes on part of the rows, energy on the headline cells. Tests that need results on disk use
:func:`build_results`; nothing here imports the stages or needs a GPU.

Beside the forward grid: :func:`build_backward_rows` (``pass = bwd`` over the grid),
:func:`build_foreign_rows` (rows the forward figures and tables must ignore: backward, GQA, Nq != Nk
and suite rows at the headline cells), :func:`build_suite_rows` (a few model-suite cells over
two runs, for ``models/runs.csv``) and :func:`write_latency` (a ``latency.csv``).
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


PASS_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def _row(impl: str, kind: str, N: int, D: int, causal: int, *, tflops: float, variant: str = "",
         measured: bool = False, energy: bool = False, status: str = "ok", pass_: str = "fwd") -> dict:
    B, H = _shape(N, D)
    e = 2  # fp16 bytes
    flops = 4.0 * B * H * N * N * D / (2 if causal else 1) * PASS_FACTOR[pass_]
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
           "status": status, "pass": pass_}
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


#: invented backward throughput per impl (TFLOPS at large N, non-causal): C between FA2 and cuDNN
BWD_PEAK_TFLOPS = {"a": 20.0, "b": 120.0, "c": 330.0, "sdpa_flash": 280.0, "sdpa_cudnn": 360.0}


def build_backward_rows(dtypes=("fp16", "bf16"), Ns=(1024, 2048, 4096, 8192, 16384)) -> list[dict]:
    """``pass = bwd`` rows over the grid (D 64/128, causal both): stages A, B, C and SDPA FLASH and
    CUDNN; stage A runs out of memory at the longest N. Stage C's ratio to cuDNN is below 1 at short
    N and above it at long N, so a summary has both kinds of cell."""
    rows = []
    for dtype in dtypes:
        for D in DS:
            for causal in (0, 1):
                for N in Ns:
                    for impl, peak in BWD_PEAK_TFLOPS.items():
                        kind = "stage" if impl in ("a", "b", "c") else "peer"
                        if impl == "a" and N == Ns[-1]:
                            rows.append(_row(impl, kind, N, D, causal, tflops=0, status="oom", pass_="bwd")
                                        | {"dtype": dtype})
                            continue
                        fill = N / (N + (4096 if impl == "c" else 1024))  # C needs long sequences to win
                        t = peak * fill * (1.1 if D == 128 else 1.0) * (0.8 if causal else 1.0)
                        rows.append(_row(impl, kind, N, D, causal, tflops=t, pass_="bwd", measured=N == 4096)
                                    | {"dtype": dtype})
    return rows


def build_foreign_rows() -> list[dict]:
    """Rows that share (N, D, dtype, causal) and even (B, H) with the forward grid's headline cells
    but are not forward self-attention grid rows: a backward, a training step, GQA (Hkv < H), a
    query block against more keys (Nk > N) and a suite cell of the same shape. Their numbers are
    wild (10x the grid's TFLOPS, other errors), so a table or figure that mixes them in changes."""
    rows = []
    for D in DS:
        for causal in (0, 1):
            for impl, kind in (("a", "stage"), ("b", "stage"), ("c", "stage"), ("sdpa_cudnn", "peer")):
                base = _row(impl, kind, 4096, D, causal, tflops=10 * PEAK_TFLOPS[impl], measured=True,
                            energy=True) | {"run_id": "2026-11-30T10:00:00Z", "rel_err": 0.5}
                rows.append(base | {"pass": "bwd"})
                rows.append(base | {"pass": "fwd_bwd"})
                rows.append(base | {"Hkv": base["H"] // 4})
                rows.append(base | {"Nk": 2 * base["N"]})
                rows.append(base | {"cell": "same-shape-suite-cell"})
    # the ablation cell too: a backward ablation step must not join the forward waterfall
    rows.append(_row("c", "ablation", 4096, 64, 0, tflops=999.0, variant="+bwd_only_switch", pass_="bwd")
                | {"run_id": "2026-11-30T10:00:00Z"})
    return rows


#: a few cells of the model suite (names and shapes as in harness/suites.py) with the eager and the
#: CUDA-graph time of each impl, ms: (c, b, sdpa_flash, sdpa_cudnn) per cell, eager then graph
SUITE_TIMES = {
    "gpt2": ((0.50, 0.45), (0.90, 0.85), (0.60, 0.55), (0.55, 0.50)),
    "llama3-8b": ((2.00, 1.98), (4.00, 3.90), (2.60, 2.55), (2.10, 2.05)),
    "tiny": ((0.080, 0.011), (0.070, 0.012), (0.045, 0.008), (0.050, 0.009)),
    "decode-gqa": ((0.060, 0.040), (0.200, 0.180), None, (0.070, 0.045)),
}
SUITE_SHAPES = {"gpt2": (32, 12, 12, 1024, 1024, 64, 1, "bf16"), "llama3-8b": (1, 32, 8, 8192, 8192, 128, 1, "bf16"),
                "tiny": (1, 1, 1, 64, 64, 64, 1, "fp16"), "decode-gqa": (16, 32, 8, 1, 8192, 128, 0, "bf16")}
SUITE_RUNS = ("2026-12-02T01:00:00Z", "2026-12-02T02:00:00Z")


def build_suite_rows() -> list[dict]:
    """Two runs of four suite cells. In the first run C is slower than everyone (2x its times); the
    second has :data:`SUITE_TIMES`: C ahead in gpt2 and llama3-8b, behind the best SDPA backend in
    tiny (eager and GPU) and behind B eager there, and SDPA FLASH refusing decode-gqa."""
    rows = []
    for k, run in enumerate(SUITE_RUNS):
        for name, times in SUITE_TIMES.items():
            B, H, Hkv, N, Nk, D, causal, dtype = SUITE_SHAPES[name]
            for impl, t in zip(("c", "b", "sdpa_flash", "sdpa_cudnn"), times):
                row = {"run_id": run, "impl": impl, "kind": "stage" if impl in ("b", "c") else "peer", "cell": name,
                       "B": B, "H": H, "Hkv": Hkv, "N": N, "Nk": Nk, "D": D, "dtype": dtype, "causal": causal,
                       "pass": "fwd", "device": "gpu"}
                if t is None:
                    rows.append(row | {"status": "unsupported: flash needs Hkv = H here"})
                    continue
                slow = 2.0 if (k == 0 and impl == "c") else 1.0
                rows.append(row | {"status": "ok", "ms_median": t[0] * slow, "ms_p20": t[0] * slow,
                                   "ms_p80": t[0] * slow, "ms_gpu": t[1] * slow})
    return rows


def build_suite(out_dir, rows=None) -> Path:
    """Write :func:`build_suite_rows` (or ``rows``) to ``out_dir/models/runs.csv``; returns ``out_dir``."""
    out_dir = Path(out_dir)
    with RowWriter(out_dir / "models") as w:
        for row in build_suite_rows() if rows is None else rows:
            w.write(row)
    return out_dir


#: a ``harness latency`` run: impl -> µs per call (the floor first)
LATENCY_US = {"triton_empty_kernel": 5.0, "a": 120.0, "b": 60.0, "c": 40.0, "sdpa_flash": 45.0, "sdpa_cudnn": 55.0}


def write_latency(out_dir, us=None, *, run_id: str = "2026-12-02T03:00:00Z", device: str = "gpu") -> Path:
    """Append one ``harness latency`` run to ``out_dir/latency.csv`` through the harness's own writer."""
    from harness.latency import write_rows

    us = LATENCY_US if us is None else us
    floor = us["triton_empty_kernel"]
    rows = [{"run_id": run_id, "impl": impl, "kind": "floor" if impl == "triton_empty_kernel" else
             ("stage" if impl in ("a", "b", "c") else "peer"), "B": 1, "H": 8, "N": 128, "D": 64, "dtype": "fp16",
             "causal": 0, "pass": "" if impl == "triton_empty_kernel" else "fwd", "device": device, "calls": 1000,
             "us_per_call": t, "x_floor": t / floor, "status": "ok"}
            for impl, t in us.items()]
    return write_rows(out_dir, rows)
