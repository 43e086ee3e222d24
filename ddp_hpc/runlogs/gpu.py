"""GPU samples of one rank: its GPU's use and health through NVML (the ``nvidia-ml-py`` package,
module ``pynvml``: the optional extra ``ddp_hpc[gpu]``), written as ``gpu`` events from a daemon
thread of their own, at most once every ``SAMPLE_EVERY_S`` seconds (docs/status.md, "GPUs").

A ``gpu`` event holds what NVML answers of: ``util_percent`` (the GPU's busy share over NVML's
last sample period), ``mem_used_mb`` / ``mem_total_mb``, ``temp_c``, ``power_w``, ``ecc_errors``
(uncorrected ECC errors since the driver loaded; a GPU without ECC: absent) and ``xid_errors``
(the critical XID codes NVML reported since the previous sample; absent when none), with
``gpu`` (the GPU's NVML UUID). A field NVML does not answer is absent.

Which GPU: the rank's, as ``device()`` names it when a sample is due (an NVML UUID, ``GPU-...``,
or an NVML index); None (the rank has not used a GPU yet, or uses none) writes nothing. Without
``pynvml``, or when NVML cannot start (no driver), the thread ends at once and nothing is written:
no error, no event.
"""
from __future__ import annotations

import os
import sys
import threading
from types import ModuleType
from typing import Any, Callable

__all__ = ["SAMPLE_EVERY_S", "GpuSampler", "load_nvml", "nvml_id", "sample"]

SAMPLE_EVERY_S = 10.0


def load_nvml() -> ModuleType | None:
    """``pynvml``, initialised; None without the package or a driver."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound, DriverNotLoaded ...
        return None
    return pynvml


def nvml_id(device: Any) -> str | int | None:
    """The NVML name of a torch CUDA ``device`` (its UUID, ``GPU-...``), else its index through
    ``CUDA_VISIBLE_DEVICES``; None for a device that is not a CUDA one."""
    if device is None or getattr(device, "type", None) != "cuda":
        return None
    index = device.index or 0
    try:
        import torch
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    except Exception:  # noqa: BLE001 - an older torch without .uuid: the visible devices' list
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if index < len(visible):
            return int(visible[index]) if visible[index].isdigit() else visible[index]
        return index


def _handle(nvml: ModuleType, gpu: str | int) -> Any:
    if isinstance(gpu, int):
        return nvml.nvmlDeviceGetHandleByIndex(gpu)
    return nvml.nvmlDeviceGetHandleByUUID(gpu)


def _ask(nvml: ModuleType, fn: Callable[[], Any]) -> Any:
    """``fn()``, or None when NVML does not answer (not supported, no permission ...)."""
    try:
        return fn()
    except nvml.NVMLError:
        return None


def sample(nvml: ModuleType, handle: Any) -> dict:
    """One sample's fields (see the module docstring) of the GPU ``handle``."""
    out: dict = {}
    if (util := _ask(nvml, lambda: nvml.nvmlDeviceGetUtilizationRates(handle))) is not None:
        out["util_percent"] = int(util.gpu)
    if (mem := _ask(nvml, lambda: nvml.nvmlDeviceGetMemoryInfo(handle))) is not None:
        out["mem_used_mb"], out["mem_total_mb"] = round(mem.used / 2**20), round(mem.total / 2**20)
    if (temp := _ask(nvml, lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))) is not None:
        out["temp_c"] = int(temp)
    if (mw := _ask(nvml, lambda: nvml.nvmlDeviceGetPowerUsage(handle))) is not None:
        out["power_w"] = round(mw / 1000.0, 1)
    ecc = _ask(nvml, lambda: nvml.nvmlDeviceGetTotalEccErrors(
        handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC))
    if ecc is not None:
        out["ecc_errors"] = int(ecc)
    return out


class GpuSampler:
    """The sampling thread of one rank. ``log`` has ``event(name, **fields)``; ``device()``
    names the rank's GPU for NVML (`nvml_id`), or None; ``nvml``: the module (a test's fake),
    else `load_nvml` in the thread."""

    def __init__(self, log: Any, device: Callable[[], str | int | None], *,
                 every_s: float = SAMPLE_EVERY_S, nvml: ModuleType | None = None) -> None:
        self.log, self.device, self.every_s, self.nvml = log, device, every_s, nvml
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gpu: str | int | None = None
        self._handle: Any = None
        self._xids: Any = None       # the NVML event set of the GPU's critical XID errors

    def start(self) -> "GpuSampler":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ddp_hpc-gpu", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.every_s):
                if self.device() is None:     # no GPU used yet: NVML is not even loaded
                    continue
                if self.nvml is None:
                    self.nvml = load_nvml()
                    if self.nvml is None:     # no pynvml, or no driver: nothing, no error
                        return
                self.once()
        except Exception as exc:  # noqa: BLE001 - sampling must never take the rank down
            print(f"ddp_hpc: GPU sampling stopped: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    def once(self) -> dict | None:
        """Take one sample and write it as a ``gpu`` event (None: no GPU to sample yet)."""
        nvml, gpu = self.nvml, self.device()
        if nvml is None or gpu is None:
            return None
        if gpu != self._gpu:
            handle = _ask(nvml, lambda: _handle(nvml, gpu))
            if handle is None:
                return None
            self._gpu, self._handle, self._xids = gpu, handle, self._watch_xids(nvml, handle)
        fields = sample(nvml, self._handle)
        if xids := self._new_xids(nvml):
            fields["xid_errors"] = xids
        fields = {"gpu": str(self._gpu), **fields}
        self.log.event("gpu", **fields)
        return fields

    @staticmethod
    def _watch_xids(nvml: ModuleType, handle: Any) -> Any:
        def register() -> Any:
            events = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
            return events
        return _ask(nvml, register)

    def _new_xids(self, nvml: ModuleType) -> list[int]:
        """The XID codes NVML reported since the last look (without waiting)."""
        out: list[int] = []
        while self._xids is not None and len(out) < 100:
            data = _ask(nvml, lambda: nvml.nvmlEventSetWait_v2(self._xids, 0))
            if data is None:   # NVML_ERROR_TIMEOUT: none waiting
                break
            out.append(int(data.eventData))
        return out
