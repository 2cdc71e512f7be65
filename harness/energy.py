"""Energy per call (J) and average power (W) from NVML's total-energy counter.

``nvmlDeviceGetTotalEnergyConsumption`` returns millijoules since the driver loaded. It updates only
about every 100 ms, so one call (micro- to milliseconds) is far below its resolution: we run ``fn``
in a loop for at least ``min_seconds`` (2 s by default), synchronized at both ends, and divide.
The loop runs back to back with no L2 flush, unlike the timing, so it is the energy of a steady stream
of calls. Clocks, temperature and the active clocks-event (throttle) reasons are read right after
the loop, to say under which conditions the number was taken.

Without NVML (no driver, no GPU, no ``nvidia-ml-py``) :func:`measure_energy` returns None and
:func:`energy_unavailable_reason` says why.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

# Documented NVML bit values; the names are read from pynvml when it has them, so a newer NVML's
# extra reasons appear by name too.
_REASON_BITS = {
    0x1: "GpuIdle", 0x2: "ApplicationsClocksSetting", 0x4: "SwPowerCap", 0x8: "HwSlowdown",
    0x10: "SyncBoost", 0x20: "SwThermalSlowdown", 0x40: "HwThermalSlowdown",
    0x80: "HwPowerBrakeSlowdown", 0x100: "DisplayClockSetting",
}


@dataclass(frozen=True)
class Energy:
    j_per_call: float
    power_w: float
    calls: int
    seconds: float
    sm_clock_mhz: float | None
    mem_clock_mhz: float | None
    temp_c: float | None
    throttle_reasons: str  # names joined by "|"; "" when none


_nvml_state: dict = {}


def _nvml():
    """The initialised pynvml module, or raise with the reason."""
    if "module" in _nvml_state:
        return _nvml_state["module"]
    if "error" in _nvml_state:
        raise RuntimeError(_nvml_state["error"])
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
        _nvml_state["error"] = f"NVML unavailable ({type(e).__name__}: {e})"
        raise RuntimeError(_nvml_state["error"]) from None
    _nvml_state["module"] = pynvml
    return pynvml


def energy_unavailable_reason() -> str | None:
    """None when NVML works on this machine, else a one-line reason."""
    if not torch.cuda.is_available():
        return "no CUDA GPU: energy not measured"
    try:
        nvml_handle()
    except RuntimeError as e:
        return str(e)
    return None


def nvml_handle(device_index: int | None = None):
    """The NVML handle of the CUDA device torch uses (matched by UUID, so CUDA_VISIBLE_DEVICES is respected)."""
    pynvml = _nvml()
    idx = torch.cuda.current_device() if device_index is None else device_index
    props = torch.cuda.get_device_properties(idx)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        text = str(uuid)
        for candidate in (text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}", text):
            try:
                return pynvml.nvmlDeviceGetHandleByUUID(candidate)
            except Exception:
                pass
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        pci = f"{getattr(props, 'pci_domain_id', 0):08X}:{bus:02X}:{getattr(props, 'pci_device_id', 0):02X}.0"
        try:
            return pynvml.nvmlDeviceGetHandleByPciBusId(pci)
        except Exception:
            pass
    return pynvml.nvmlDeviceGetHandleByIndex(idx)


def throttle_reason_names(mask: int) -> list[str]:
    """NVML clocks-event reason bitmask -> names (``SwPowerCap``, ``HwThermalSlowdown``, ...)."""
    names = dict(_REASON_BITS)
    try:
        import pynvml

        for attr in dir(pynvml):
            for prefix in ("nvmlClocksEventReason", "nvmlClocksThrottleReason"):
                if attr.startswith(prefix):
                    short = attr[len(prefix):]
                    value = getattr(pynvml, attr)
                    if short not in ("All", "None", "Unknown") and isinstance(value, int) and value and \
                            value & (value - 1) == 0:
                        names.setdefault(value, short)
    except ImportError:
        pass
    return [name for bit, name in sorted(names.items()) if mask & bit]


def device_conditions(handle) -> dict:
    """SM and memory clocks (MHz), temperature (°C) and active clocks-event reasons, now."""
    pynvml = _nvml()
    out: dict = {"sm_clock_mhz": None, "mem_clock_mhz": None, "temp_c": None, "throttle_reasons": ""}
    try:
        out["sm_clock_mhz"] = float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
        out["mem_clock_mhz"] = float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM))
    except Exception:
        pass
    try:
        out["temp_c"] = float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
    except Exception:
        pass
    getter = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        getattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
    try:
        out["throttle_reasons"] = "|".join(throttle_reason_names(int(getter(handle))))
    except Exception:
        pass
    return out


def measure_energy(fn: Callable[[], object], est_ms: float | None = None, min_seconds: float = 2.0) -> Energy | None:
    """Run ``fn`` back to back for >= ``min_seconds`` and read NVML's energy counter around the loop.

    ``est_ms`` (e.g. the median from timing) sizes the batches between the clock checks; the
    loop only synchronizes between batches of ~0.25 s so launches stay queued. None without NVML.
    """
    if energy_unavailable_reason() is not None:
        return None
    pynvml = _nvml()
    handle = nvml_handle()
    per_batch = max(1, int(math.ceil(250.0 / max(est_ms or 1.0, 1e-3))))
    torch.cuda.synchronize()
    e0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # mJ
    t0 = time.perf_counter()
    calls = 0
    while True:
        for _ in range(per_batch):
            fn()
        calls += per_batch
        torch.cuda.synchronize()
        if time.perf_counter() - t0 >= min_seconds:
            break
    t1 = time.perf_counter()
    e1 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    cond = device_conditions(handle)
    joules = (e1 - e0) / 1e3
    seconds = t1 - t0
    return Energy(j_per_call=joules / calls, power_w=joules / seconds, calls=calls, seconds=seconds, **cond)
