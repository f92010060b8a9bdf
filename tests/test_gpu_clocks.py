"""The GPU clock / power record of a timed window (harness.measure.gpu_clocks), with a stand-in for the driver's
NVML."""

from __future__ import annotations

import ctypes
import math
import threading
import time

import pytest
from conftest import cpu_cfg

from harness.measure import gpu_clocks as gc
from harness.measure.timing import combine_clocks


class FakeNvml:
    """The driver's view: sample buffers that grow as time passes, cumulative violation counters in ns."""

    def __init__(self):
        self.clk = [1980.0]  # the SM clock now (the last entry)
        self.pw = [(100, 120_000.0)]
        self.viol = {gc.PERF_POLICY_POWER: 5_000, gc.PERF_POLICY_THERMAL: 0}
        self.broken = False
        self.poll_gate = threading.Event()  # set: the clock thread may read (the tests that need no order open it)
        self.poll_gate.set()

    def handle(self, device):
        if device != "GPU-0":
            raise LookupError(device)
        return "h0"

    def samples(self, h, kind, since_us):
        if self.broken:
            raise RuntimeError("driver went away")
        assert kind == gc.TOTAL_POWER_SAMPLES
        return [(t, v) for t, v in self.pw if t > since_us]

    def clock_mhz(self, h):
        if self.broken:
            raise RuntimeError("driver went away")
        if threading.current_thread().name == "gpu-clock":  # the window's thread reads once the test opens the gate
            self.poll_gate.wait()
        return self.clk[-1]

    def violation_ns(self, h, policy):
        return self.viol[policy]

    def run_window(self, wall_ns_ignored=None):  # what the driver records while the timed iterations run
        self.pw += [(300, 690_000.0), (400, 700_000.0)]
        self.viol[gc.PERF_POLICY_POWER] += 10**18  # far longer than the window: the share is capped at 1


def wait_for_readings(w, n):
    """Until the clock thread has taken its first reading; the deadline is only a safety net for a thread that never
    reads (the reading comes 10 ms after the gate opens on an idle machine)."""
    deadline = time.monotonic() + 120
    while len(w._mhz) < n and time.monotonic() < deadline:
        time.sleep(gc.POLL_S)
    assert len(w._mhz) >= n, "the clock thread took no reading"


def test_the_window_reads_only_the_samples_taken_inside_it():
    nv = FakeNvml()
    nv.poll_gate.clear()  # the clock thread reads only once the clock below has dropped, however late it runs
    w = gc.ClockWatch(["GPU-0"], nvml=nv)
    nv.clk = [1980.0, 1500.0]  # idle clock before the window: never read
    w.start()  # one reading at the start (1500)
    assert w._mhz == [1500.0]
    nv.clk.append(1200.0)
    nv.poll_gate.set()
    wait_for_readings(w, 2)  # the thread's readings while the window is open
    nv.clk.append(1500.0)
    nv.run_window()
    r = w.stop()  # and one at the end (1500)
    assert w._poller is None and not any(t.name == "gpu-clock" for t in threading.enumerate())  # the thread ended
    assert r["sm_clock_min_mhz"] == 1200.0 and r["sm_clock_mhz"] in (1200.0, 1350.0, 1500.0)
    assert 1980.0 not in w._mhz
    assert w.stop() == r  # asked again: the same window, not an empty one
    assert r["power_w"] == pytest.approx(695.0)
    assert r["power_capped_fraction"] == 1.0 and r["thermal_capped_fraction"] == 0.0


def test_the_limit_share_is_violation_time_over_wall_time():
    f = gc.summarize([1980.0], [100_000.0], power_ns=250, thermal_ns=None, wall_ns=1000)
    assert f["power_capped_fraction"] == 0.25 and math.isnan(f["thermal_capped_fraction"])
    assert f["power_w"] == 100.0 and f["sm_clock_mhz"] == f["sm_clock_min_mhz"] == 1980.0
    assert all(math.isnan(v) for v in gc.summarize([], [], None, None, 1000).values())


def test_a_missing_driver_or_device_gives_nan_never_an_error():
    nv = FakeNvml()
    for w in (gc.ClockWatch([], nvml=nv), gc.ClockWatch(["GPU-7", 3], nvml=nv)):  # no ids / unknown to NVML
        w.start()
        assert all(math.isnan(v) for v in w.stop().values()) and w.error
    w = gc.ClockWatch(["GPU-7", "GPU-0"], nvml=nv)  # the second name is found
    assert w.h == "h0"
    w.start()
    nv.broken = True  # the sample buffer and the clock fail, the violation counters still answer
    r = w.stop()
    assert math.isnan(r["power_w"]) and "driver went away" in w.error
    assert r["sm_clock_mhz"] == 1980.0  # the one clock reading taken (at the start) still counts
    assert r["power_capped_fraction"] == 0.0 and r["thermal_capped_fraction"] == 0.0
    w = gc.ClockWatch(["GPU-0"], nvml=nv)
    w.start()  # refused at the start: those fields stay NaN, never an exception
    r = w.stop()
    assert math.isnan(r["sm_clock_mhz"]) and math.isnan(r["power_w"])


def test_a_window_started_twice_leaves_one_clock_thread():
    w = gc.ClockWatch(["GPU-0"], nvml=FakeNvml())
    w.start()
    first = w._poller
    w.start()  # e.g. the timed iterations of the first window raised before stop()
    assert not first.is_alive() and w._poller.is_alive()
    w.stop()
    assert not any(t.name == "gpu-clock" for t in threading.enumerate())


def test_ranks_combine_to_the_slowest_clock_and_the_largest_power():
    nan = float("nan")
    out = combine_clocks([[1900.0, 1500.0, 600.0, 0.2, 0.0], [1700.0, 1600.0, 650.0, 0.1, nan]])
    assert out == {"sm_clock_mhz": 1700.0, "sm_clock_min_mhz": 1500.0, "power_w": 650.0,
                   "power_capped_fraction": 0.2, "thermal_capped_fraction": 0.0}
    assert all(math.isnan(v) for v in combine_clocks([[nan] * 5, [nan] * 5]).values())


def test_nvml_structs_have_the_header_layout():
    assert ctypes.sizeof(gc._Sample) == 16 and ctypes.sizeof(gc._Violation) == 16  # u64 + 8-byte union; u64 x 2


@pytest.mark.slow
def test_cpu_rows_carry_the_clock_columns_empty(results_dir):
    from harness.measure.runner import run_benchmark

    df = run_benchmark(cpu_cfg(results_dir, "ep_size=1", "backends=[nccl]", "directions=[fwd]"))
    assert (df.status == "ok").all()
    for f in gc.FIELDS:
        assert f in df.columns and df[f].isna().all()  # no GPU: nothing to read, and said so by NaN
