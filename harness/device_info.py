"""What GPU the results come from: name, driver, CUDA, SMs, L2, memory, clocks, power limit.

Recorded into ``env.json`` beside every run (:func:`gpu_env`); NVML fields are left out (with a
note) when NVML is unavailable.
"""

from __future__ import annotations

import platform

import torch

from . import timing
from .results import slugify


def gpu_env(device_index: int | None = None) -> dict:
    """GPU provenance for env.json (empty dict on a machine without CUDA)."""
    if not torch.cuda.is_available():
        return {}
    idx = torch.cuda.current_device() if device_index is None else device_index
    props = torch.cuda.get_device_properties(idx)
    env = {
        "gpu_name": props.name,
        "gpu_slug": slugify(props.name),
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "memory_bytes": props.total_memory,
        "cuda_runtime": torch.version.cuda,
        "gpu_count": torch.cuda.device_count(),
        "timing": timing.METHOD,
        "stage_c_tuning": _stage_c_tuning(slugify(props.name), 10 * props.major + props.minor),
    }
    try:
        from .energy import _nvml, nvml_handle

        pynvml = _nvml()
        h = nvml_handle(idx)

        def safe(fn, *a):
            try:
                value = fn(*a)
                return value.decode() if isinstance(value, bytes) else value
            except Exception:
                return None

        env["driver"] = safe(pynvml.nvmlSystemGetDriverVersion)
        cuda_drv = safe(pynvml.nvmlSystemGetCudaDriverVersion_v2) or safe(pynvml.nvmlSystemGetCudaDriverVersion)
        if cuda_drv:
            env["cuda_driver"] = f"{cuda_drv // 1000}.{(cuda_drv % 1000) // 10}"
        env["sm_clock_mhz"] = safe(pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM)
        env["mem_clock_mhz"] = safe(pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_MEM)
        env["max_sm_clock_mhz"] = safe(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_SM)
        env["max_mem_clock_mhz"] = safe(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_MEM)
        limit_mw = safe(pynvml.nvmlDeviceGetPowerManagementLimit, h)
        env["power_limit_w"] = limit_mw / 1000 if limit_mw is not None else None
        enforced = safe(pynvml.nvmlDeviceGetEnforcedPowerLimit, h)
        env["enforced_power_limit_w"] = enforced / 1000 if enforced is not None else None
    except RuntimeError as e:
        env["nvml_note"] = str(e)
    return env


def _stage_c_tuning(slug: str, arch: int) -> dict:
    """Which tuning files stage C's choices read on this GPU (``stages/c_optimized/tuned/``): its own, or
    a same-architecture GPU's where it was never tuned (an H100 runs the H200's winners), or none."""
    from stages.c_optimized.configs import tuning_file

    return {kind: (path.stem if (path := tuning_file(slug, suffix, arch)) else None)
            for kind, suffix in (("forward", ""), ("backward", "-backward"))}


def cpu_env() -> dict:
    """Provenance of a CPU (Triton interpreter) run."""
    return {"gpu_name": None, "gpu_slug": "cpu-interpreter", "cpu": platform.processor() or platform.machine(),
            "note": "no CUDA GPU: stages ran in the Triton interpreter; times are not GPU times"}


def device_slug() -> str:
    """``h200`` on an H200; ``cpu-interpreter`` without a GPU."""
    if torch.cuda.is_available():
        return slugify(torch.cuda.get_device_name())
    return "cpu-interpreter"
