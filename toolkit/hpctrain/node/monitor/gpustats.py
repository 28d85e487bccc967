"""This rank's GPU utilization, memory and temperature for its heartbeat, through NVML (nvidia-ml-py).

nvidia-ml-py is the optional extra `gpu` (`pip install hpctrain[gpu]`), imported on first use: without it,
or on a CPU rank, or when NVML cannot answer, `read()` returns {} and the beat carries no GPU fields.
"""

from __future__ import annotations

import os
from typing import Any


class GpuStats:
    """NVML handle of this rank's device (CUDA_VISIBLE_DEVICES[local_rank] when it lists indices)."""

    def __init__(self, local_rank: int) -> None:
        self.local_rank = local_rank
        self._nvml: Any = None
        self._handle: Any = None
        self._off = False

    def _open(self) -> bool:
        if self._off:
            return False
        if self._handle is not None:
            return True
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
            dev = visible[self.local_rank % len(visible)] if visible else str(self.local_rank)
            self._handle = (pynvml.nvmlDeviceGetHandleByIndex(int(dev)) if dev.isdigit()
                            else pynvml.nvmlDeviceGetHandleByUUID(dev))
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no extra, no driver, a MIG or odd device name: no GPU fields
            self._off = True
            return False
        return True

    def read(self) -> dict[str, float]:
        if not self._open():
            return {}
        nv = self._nvml
        try:
            util = nv.nvmlDeviceGetUtilizationRates(self._handle)
            mem = nv.nvmlDeviceGetMemoryInfo(self._handle)
            temp = nv.nvmlDeviceGetTemperature(self._handle, nv.NVML_TEMPERATURE_GPU)
        except Exception:  # noqa: BLE001 - one failed read: skip this beat's GPU fields
            return {}
        return {"gpu_util": float(util.gpu), "gpu_mem_used_gb": round(mem.used / 1e9, 3), "gpu_temp_c": float(temp)}
