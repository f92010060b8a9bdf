"""Device memory beside speed (harness.measure.memory): the arithmetic on a stand-in of the CUDA counters, and the
columns left empty on the CPU."""

from __future__ import annotations

import math

import pytest
import torch

from harness.measure import memory
from harness.core import results
from harness.measure.timing import combine_memory


class FakeDevice:
    """A device allocator with counters: allocations move ``allocated``, the peak follows it until reset."""

    def __init__(self, total: int = 1000, other: int = 100) -> None:
        self.total, self.other, self.now, self.high, self.syncs = total, other, 0, 0, 0
        self.pools: dict[tuple, tuple[int, int]] = {}  # CUDA graph pools: id -> (reserved, allocated)

    def alloc(self, n: int) -> None:
        self.now += n
        self.high = max(self.high, self.now)

    def probe(self) -> memory.Probe:
        def reset():
            self.high = self.now

        def sync():
            self.syncs += 1

        return memory.Probe(allocated=lambda: self.now, peak=lambda: self.high, reset_peak=reset,
                            free_total=lambda: (self.total - self.now - self.other, self.total), sync=sync,
                            graph_pools=lambda: dict(self.pools))


def test_the_window_reads_the_peak_inside_it_and_the_used_memory_around_it():
    dev = FakeDevice()
    dev.alloc(300)
    dev.alloc(-200)  # a peak before the window is not the window's
    w = memory.Window(dev.probe())
    w.open()
    dev.alloc(50)
    dev.alloc(-50)
    fields = w.close()
    own = fields.pop("mem_peak_own_bytes")
    assert math.isnan(fields.pop("mem_graph_pool_bytes"))
    assert fields == {"mem_peak_allocated_bytes": 150.0, "mem_device_used_before_bytes": 200.0,
                      "mem_device_used_peak_bytes": 200.0}
    assert math.isnan(own)  # no base given: the backend's own peak is not known
    assert dev.syncs == 2  # the counters are read after the device's work is done


def test_the_own_peak_is_the_window_peak_less_what_was_held_before_the_backend():
    """What the point's inputs (and anything before the backend's setup) hold is not the backend's."""
    dev = FakeDevice()
    dev.alloc(400)  # the point's inputs
    w = memory.Window(dev.probe())
    w.base = memory.allocated(dev.probe())  # the backend's setup begins
    dev.alloc(120)  # its weights' copy, its workspace
    w.open()
    dev.alloc(80)  # activations and gradients of the timed iterations
    dev.alloc(-80)
    fields = w.close()
    assert fields["mem_peak_allocated_bytes"] == 600.0
    assert fields["mem_peak_own_bytes"] == 200.0
    assert fields["mem_graph_pool_bytes"] == 0.0


def test_the_own_peak_holds_the_free_bytes_of_the_cuda_graph_pools_the_backend_made():
    """A replayed graph allocates nothing: its intermediates are free blocks of its private pool, which the
    allocator's peak misses. The own peak adds them; what a pool holds allocated (the graphs' outputs) is in the peak
    already, and a pool made before the backend's setup (an earlier backend's) is not the backend's."""
    dev = FakeDevice()
    dev.pools[(1, 0)] = (500, 100)  # an earlier backend's graphs
    dev.alloc(400)  # the point's inputs
    w = memory.Window(dev.probe())
    w.set_base(memory.allocated(dev.probe()))
    dev.alloc(120)  # setup
    dev.pools[(2, 0)] = (300, 40)  # capture: 300 reserved, 40 of it the graphs' outputs (allocated, in the peak)
    dev.alloc(40)
    dev.pools[(1, 0)] = (900, 100)  # the earlier pool grew: still not this backend's
    w.open()
    fields = w.close()  # replays: nothing allocated
    assert fields["mem_graph_pool_bytes"] == 260.0
    assert fields["mem_peak_own_bytes"] == 120 + 40 + 260.0
    assert fields["mem_peak_allocated_bytes"] == 560.0


def test_the_cuda_probe_reads_the_private_pools_from_the_allocators_segments(monkeypatch):
    """The default pool (id (0, 0)) and other devices' segments are left out; a pool's segments add up."""
    segs = [dict(device=0, segment_pool_id=(0, 0), total_size=1000, allocated_size=10),
            dict(device=0, segment_pool_id=(3, 1), total_size=200, allocated_size=50),
            dict(device=0, segment_pool_id=(3, 1), total_size=100, allocated_size=0),
            dict(device=1, segment_pool_id=(3, 1), total_size=7000, allocated_size=0),
            dict(device=0, segment_pool_id=(4, 0), total_size=64, allocated_size=64)]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda **kw: segs)
    assert memory._cuda_graph_pools(torch.device("cuda", 0)) == {(3, 1): (300, 50), (4, 0): (64, 64)}


def test_the_activation_bytes_are_what_a_forward_keeps_less_its_output():
    dev = FakeDevice()
    out = torch.zeros(4, 8, dtype=torch.bfloat16)  # 64 bytes

    def forward():
        dev.alloc(64 + 200)  # the output and 200 bytes saved for the backward
        return out

    assert memory.activation_bytes(dev.probe(), forward) == 200.0
    before = memory.allocated(dev.probe())
    dev.alloc(30)
    assert memory.held_since(dev.probe(), before) == 30.0


def test_the_cpu_has_no_memory_fields():
    cpu = torch.device("cpu")
    assert memory.Probe.of(cpu) is None
    assert all(math.isnan(v) for v in memory.Window(None).close().values())
    assert math.isnan(memory.activation_bytes(None, lambda: pytest.fail("no forward on the CPU")))
    assert math.isnan(memory.held_since(None, None))


def test_the_ranks_memory_is_the_largest():
    nan = float("nan")
    combined = combine_memory([[10.0, 1.0, nan, 3.0, 0.0], [5.0, 2.0, nan, 4.0, 7.0]])
    assert combined["mem_peak_allocated_bytes"] == 10.0 and combined["mem_device_used_before_bytes"] == 2.0
    assert math.isnan(combined["mem_device_used_peak_bytes"])
    assert combined["mem_peak_own_bytes"] == 4.0  # each rank's own peak, the largest
    assert combined["mem_graph_pool_bytes"] == 7.0


def test_every_memory_field_is_a_column_of_bytes():
    for f in memory.FIELDS:
        assert results.COLUMNS[f] == "Int64" and f.endswith("_bytes")


def test_cpu_rows_leave_the_memory_columns_empty(tmp_path):
    """A CPU run measures no device memory: the columns exist and are empty, and no extra forward runs for them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import cpu_cfg

    from harness.measure.runner import run_benchmark

    df = run_benchmark(cpu_cfg(tmp_path / "results", "backends=[nccl]"))
    assert len(df) == 2 and (df["status"] == "ok").all()
    for f in memory.FIELDS:
        assert df[f].isna().all(), f
