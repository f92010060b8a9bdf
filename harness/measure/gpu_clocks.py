"""The GPU's clock and power limits over a timed window, from NVML (the driver's ``libnvidia-ml``).

A board at its power limit lowers its SM clock (on 2xH200 from 1980 to 1185-1545 MHz while these layers run), so
two rows of one backend can differ by the clock they ran at. Each timed row records:

* ``sm_clock_mhz`` / ``sm_clock_min_mhz``: median and minimum of the SM clock, read every 10 ms through the window;
* ``power_w``: mean of the driver's board power samples inside the window;
* ``power_capped_fraction`` / ``thermal_capped_fraction``: the share of the window's wall time the driver counted as
  held below the requested clocks by the power / thermal limit (its cumulative violation counters, read before and
  after).

The power samples and the limit counters are kept by the driver itself and read once before and once after the
window. The SM clock has no such record on the 2xH200 driver (580.159: its clock sample buffer gave no sample inside
any window), so one thread reads the current SM clock (``nvmlDeviceGetClockInfo``) every 10 ms while the window is
open, plus once at its start and once at its end. It holds the GIL for a few microseconds per reading (ctypes drops
it inside the call), well under 0.1% of the window. Without NVML (no GPU, no driver) every field is NaN.
"""

from __future__ import annotations

import ctypes
import math
import statistics
import threading
import time
from typing import Any, Optional, Sequence

FIELDS = ("sm_clock_mhz", "sm_clock_min_mhz", "power_w", "power_capped_fraction", "thermal_capped_fraction")

# nvml.h: nvmlSamplingType_t, nvmlClockType_t, nvmlPerfPolicyType_t, nvmlValueType_t, return codes
TOTAL_POWER_SAMPLES = 0
CLOCK_SM = 1
POLL_S = 0.010
PERF_POLICY_POWER, PERF_POLICY_THERMAL = 0, 1
_SUCCESS, _NOT_FOUND = 0, 6


class _Value(ctypes.Union):
    _fields_ = [("dVal", ctypes.c_double), ("uiVal", ctypes.c_uint), ("ulVal", ctypes.c_ulong),
                ("ullVal", ctypes.c_ulonglong), ("sllVal", ctypes.c_longlong), ("siVal", ctypes.c_int)]


_VALUE_FIELD = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}  # by nvmlValueType_t


class _Sample(ctypes.Structure):
    _fields_ = [("timeStamp", ctypes.c_ulonglong), ("sampleValue", _Value)]


class _Violation(ctypes.Structure):
    _fields_ = [("referenceTime", ctypes.c_ulonglong), ("violationTime", ctypes.c_ulonglong)]  # us, ns


class Nvml:
    """The few NVML calls used here, through ctypes (no Python package needed)."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib

    @classmethod
    def load(cls) -> Optional["Nvml"]:
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() != _SUCCESS:
                return None
        except (OSError, AttributeError):
            return None
        return cls(lib)

    def handle(self, device: "str | int") -> Any:
        """A device by its UUID ("GPU-...") or its NVML index."""
        h = ctypes.c_void_p()
        if isinstance(device, str):
            rc = self.lib.nvmlDeviceGetHandleByUUID(device.encode(), ctypes.byref(h))
        else:
            rc = self.lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(device), ctypes.byref(h))
        if rc != _SUCCESS:
            raise LookupError(f"NVML knows no device {device} (return code {rc})")
        return h

    def samples(self, h: Any, kind: int, since_us: int) -> list[tuple[int, float]]:
        """(timestamp in us, value) of the driver's buffered samples newer than ``since_us``."""
        vtype, count = ctypes.c_uint(), ctypes.c_uint(0)
        rc = self.lib.nvmlDeviceGetSamples(h, kind, ctypes.c_ulonglong(since_us), ctypes.byref(vtype),
                                           ctypes.byref(count), None)
        if rc == _NOT_FOUND or (rc == _SUCCESS and count.value == 0):
            return []
        if rc != _SUCCESS:
            raise RuntimeError(f"nvmlDeviceGetSamples({kind}) returned {rc}")
        n = count.value + 64  # room for samples the driver adds between the two calls
        buf, count = (_Sample * n)(), ctypes.c_uint(n)
        rc = self.lib.nvmlDeviceGetSamples(h, kind, ctypes.c_ulonglong(since_us), ctypes.byref(vtype),
                                           ctypes.byref(count), buf)
        if rc == _NOT_FOUND:
            return []
        if rc != _SUCCESS:
            raise RuntimeError(f"nvmlDeviceGetSamples({kind}) returned {rc}")
        field = _VALUE_FIELD.get(vtype.value, "uiVal")
        return [(int(s.timeStamp), float(getattr(s.sampleValue, field))) for s in buf[: count.value]]

    def clock_mhz(self, h: Any) -> float:
        """The SM clock now."""
        mhz = ctypes.c_uint()
        rc = self.lib.nvmlDeviceGetClockInfo(h, CLOCK_SM, ctypes.byref(mhz))
        if rc != _SUCCESS:
            raise RuntimeError(f"nvmlDeviceGetClockInfo(SM) returned {rc}")
        return float(mhz.value)

    def violation_ns(self, h: Any, policy: int) -> int:
        v = _Violation()
        if self.lib.nvmlDeviceGetViolationStatus(h, policy, ctypes.byref(v)) != _SUCCESS:
            raise RuntimeError(f"nvmlDeviceGetViolationStatus({policy}) failed")
        return int(v.violationTime)


def summarize(sm_mhz: Sequence[float], power_mw: Sequence[float], power_ns: Optional[int],
              thermal_ns: Optional[int], wall_ns: int) -> dict[str, float]:
    """The row fields of one window (NaN where there is no sample or no counter)."""
    nan = math.nan

    def frac(ns: Optional[int]) -> float:
        return min(1.0, max(0.0, ns / wall_ns)) if ns is not None and wall_ns > 0 else nan

    return {
        "sm_clock_mhz": statistics.median(sm_mhz) if sm_mhz else nan,
        "sm_clock_min_mhz": min(sm_mhz) if sm_mhz else nan,
        "power_w": statistics.fmean(power_mw) / 1e3 if power_mw else nan,
        "power_capped_fraction": frac(power_ns),
        "thermal_capped_fraction": frac(thermal_ns),
    }


def empty() -> dict[str, float]:
    return {f: math.nan for f in FIELDS}


class ClockWatch:
    """``start()`` before the timed iterations, ``stop()`` after the device finished them (after a synchronize).
    ``nvml``: an :class:`Nvml` (or a stand-in with the same methods); None = load the driver's library."""

    _loaded: Optional[Nvml] = None
    _tried = False

    def __init__(self, ids: Sequence["str | int"], nvml: Optional[Any] = None) -> None:
        """``ids``: the device's names to NVML, tried in order (:func:`device_ids`)."""
        self.nvml, self.h, self.error = nvml, None, None
        self._poller: Optional[threading.Thread] = None  # the clock thread of the open window
        self._last: Optional[dict[str, float]] = None  # the fields of the last closed window
        self._mhz: list[float] = []
        if not ids:
            self.error = "not a CUDA device"
            return
        if self.nvml is None:
            if not ClockWatch._tried:
                ClockWatch._tried, ClockWatch._loaded = True, Nvml.load()
            self.nvml = ClockWatch._loaded
        if self.nvml is None:
            self.error = "NVML (libnvidia-ml.so.1) not available"
            return
        for i in ids:
            try:
                self.h = self.nvml.handle(i)
                break
            except Exception as e:  # noqa: BLE001 - a missing reading never stops a run
                self.error = str(e)

    def _read(self, kind: str, arg: int) -> Any:
        """One reading: ``samples`` (sampling type ``arg``: the newest timestamp now) or ``violation`` (policy
        ``arg``: the counter now)."""
        if kind == "samples":
            return max((t for t, _ in self.nvml.samples(self.h, arg, 0)), default=time.time_ns() // 1000)
        return self.nvml.violation_ns(self.h, arg)

    _READINGS = (("samples", TOTAL_POWER_SAMPLES), ("violation", PERF_POLICY_POWER),
                 ("violation", PERF_POLICY_THERMAL))

    def _clock(self) -> None:
        try:
            self._mhz.append(self.nvml.clock_mhz(self.h))
        except Exception as e:  # noqa: BLE001 - a missing reading never stops a run
            self.error = str(e)

    def _poll(self, stop: threading.Event) -> None:
        while not stop.wait(POLL_S):
            self._clock()

    def start(self) -> None:
        """Mark where each reading stands and start reading the SM clock; one the driver refuses stays NaN, the
        others are still taken."""
        if self._poller is not None:  # started twice: end the first window's thread
            self._stop.set()
            self._poller.join()
        self._mark: dict[tuple[str, int], Any] = {}
        self._mhz: list[float] = []
        self._poller = self._last = None
        if self.h is None:
            return
        for r in self._READINGS:
            try:
                self._mark[r] = self._read(*r)
            except Exception as e:  # noqa: BLE001 - a missing reading never stops a run
                self.error = str(e)
        self._clock()
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, args=(self._stop,), name="gpu-clock", daemon=True)
        self._poller.start()
        self._t0 = time.perf_counter_ns()

    def stop(self) -> dict[str, float]:
        """The window's fields; a second ``stop()`` without a ``start()`` gives the same ones."""
        if self._poller is None:  # no window open: the last one's fields, if any
            return self._last if self._last is not None else empty()
        wall = time.perf_counter_ns() - self._t0
        self._stop.set()
        self._poller.join()
        self._poller = None
        self._clock()
        got: dict[tuple[str, int], Any] = {}
        for r, since in self._mark.items():
            try:
                if r[0] == "samples":
                    got[r] = [v for _, v in self.nvml.samples(self.h, r[1], since)]
                else:
                    got[r] = self.nvml.violation_ns(self.h, r[1]) - since
            except Exception as e:  # noqa: BLE001
                self.error = str(e)
        self._last = summarize(self._mhz, got.get(("samples", TOTAL_POWER_SAMPLES), []),
                               got.get(("violation", PERF_POLICY_POWER)), got.get(("violation", PERF_POLICY_THERMAL)),
                               wall)
        return self._last


def device_ids(device: Any) -> list["str | int"]:
    """NVML's names of a CUDA device: its UUID ("GPU-..."), then its NVML index (CUDA_VISIBLE_DEVICES applied);
    none off CUDA."""
    import torch

    if getattr(device, "type", None) != "cuda":
        return []
    ids: list[str | int] = []
    try:
        ids.append("GPU-" + str(torch.cuda.get_device_properties(device).uuid).removeprefix("GPU-"))
    except Exception:  # noqa: BLE001
        pass
    try:
        ids.append(torch.cuda._get_nvml_device_index(device))
    except Exception:  # noqa: BLE001
        pass
    return ids
