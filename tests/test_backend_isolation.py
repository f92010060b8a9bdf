"""Backends cost each other nothing: the clean-up between backends, memory that does not come back, and backends in
processes of their own (harness/measure/runner.py), on CPU ranks with a stand-in device-memory probe."""

from __future__ import annotations

import pytest

from conftest import cpu_cfg, run_here, use_fake_backends
from harness.measure import runner

FAKES = ("holds_memory=fake_backends:HoldsMemoryAndFails,leaks_memory=fake_backends:LeaksMemory,"
         "fails_setup=fake_backends:FailsSetup,spoils_inputs=fake_backends:SpoilsInputs,"
         "replays_graphs=fake_backends:ReplaysGraphs")
PROBE = "fake_backends:fake_probe"


def _rows(df, backend):
    return df[df["backend"] == backend].sort_values("direction")


@pytest.mark.parametrize("cleanup", [True, False], ids=["cleanup", "cleanup-removed"])
def test_failed_backend_gives_its_memory_back(monkeypatch, results_dir, cleanup):
    """A backend that took memory and raised costs the next one nothing: with the clean-up, nccl runs after it in the
    same process; with the clean-up removed, the memory stays and the harness says so in the next backend's rows
    (under torchrun it cannot start fresh processes: error rows naming the backend and the memory)."""
    use_fake_backends(monkeypatch, FAKES)
    monkeypatch.setenv("MOKBENCH_MEMORY_PROBE", PROBE)
    if not cleanup:
        monkeypatch.setattr(runner, "drop_compiled_state", lambda: None)
    df = run_here(monkeypatch, cpu_cfg(results_dir, "ep_size=1", "backends=[holds_memory,nccl]"))
    held = _rows(df, "holds_memory")
    assert list(held["status"]) == ["error", "error"] and held["error"].str.contains("boom after taking").all()
    nccl = _rows(df, "nccl")
    if cleanup:
        assert list(nccl["status"]) == ["ok", "ok"], nccl[["status", "error"]]
        assert not nccl["notes"].fillna("").str.contains("fresh processes").any()
    else:
        assert list(nccl["status"]) == ["error", "error"]
        assert nccl["error"].str.contains("device memory did not come back after holds_memory").all()
        assert nccl["error"].str.contains("4.0 GiB").all()
        assert nccl["error"].str.contains("torchrun").all()


@pytest.mark.slow
def test_memory_that_stays_sends_the_next_backends_to_fresh_processes(monkeypatch, results_dir):
    """Spawned ranks: a backend that keeps memory for good sends every backend after it to a fresh set of ranks, in
    the same run and job file; their rows are ok and say why they ran there; the earlier rows are kept."""
    use_fake_backends(monkeypatch, FAKES)
    monkeypatch.setenv("MOKBENCH_MEMORY_PROBE", PROBE)
    df = runner.run_benchmark(cpu_cfg(results_dir, "ep_size=2", "backends=[nccl,leaks_memory,fails_setup]",
                                      "own_process=[fails_setup]"))
    assert sorted(df["backend"].unique()) == ["fails_setup", "leaks_memory", "nccl"]
    assert (_rows(df, "nccl")["status"] == "ok").all() and (_rows(df, "leaks_memory")["status"] == "ok").all()
    fails = _rows(df, "fails_setup")
    assert (fails["status"] == "error").all()
    assert fails["notes"].str.contains("processes of its own").all()
    assert not _rows(df, "nccl")["notes"].fillna("").str.contains("fresh processes").any()
    assert list(df.sort_values("backend_position")["backend_position"].unique()) == [0, 1, 2]
    assert df["run_id"].nunique() == 1 and df["config_hash"].nunique() == 1


@pytest.mark.slow
def test_leak_then_fresh_processes(monkeypatch, results_dir):
    use_fake_backends(monkeypatch, FAKES)
    monkeypatch.setenv("MOKBENCH_MEMORY_PROBE", PROBE)
    df = runner.run_benchmark(cpu_cfg(results_dir, "ep_size=2", "backends=[leaks_memory,nccl]"))
    nccl = _rows(df, "nccl")
    assert list(nccl["status"]) == ["ok", "ok"], nccl[["status", "error"]]
    assert nccl["notes"].str.contains("device memory did not come back after leaks_memory").all()
    assert (_rows(df, "leaks_memory")["status"] == "ok").all()


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "check-removed"])
def test_a_backend_that_changes_the_inputs_spoils_no_later_row(monkeypatch, results_dir, checked):
    """A backend that leaves the point's weights changed after its rows (a layout not restored): the next backend is
    never checked or timed on those inputs. In one process (no fresh ranks to start) its rows are errors naming the
    backend and the changed input; with the check removed it would be judged on spoiled inputs (a mismatch)."""
    use_fake_backends(monkeypatch, FAKES)
    if not checked:
        monkeypatch.setattr(runner, "fingerprint", lambda inputs: {})
    df = run_here(monkeypatch, cpu_cfg(results_dir, "ep_size=1", "backends=[spoils_inputs,nccl]"))
    assert list(_rows(df, "spoils_inputs")["status"]) == ["ok", "ok"]
    nccl = _rows(df, "nccl")
    if checked:
        assert list(nccl["status"]) == ["error", "error"], nccl[["status", "error"]]
        assert nccl["error"].str.contains("spoils_inputs left the point's inputs changed (w2_LHI", regex=False).all()
    else:
        assert list(nccl["status"]) == ["mismatch", "mismatch"], nccl[["status", "error"]]


@pytest.mark.slow
def test_inputs_changed_by_a_backend_are_drawn_again_in_fresh_processes(monkeypatch, results_dir):
    """Spawned ranks: the backends after one that changed the inputs run on inputs drawn again, ok, saying why."""
    use_fake_backends(monkeypatch, FAKES)
    df = runner.run_benchmark(cpu_cfg(results_dir, "ep_size=2", "backends=[spoils_inputs,nccl]"))
    nccl = _rows(df, "nccl")
    assert list(nccl["status"]) == ["ok", "ok"], nccl[["status", "error"]]
    assert nccl["notes"].str.contains("left the point's inputs changed (w2_LHI", regex=False).all()


def test_rows_of_a_backend_replaying_cuda_graphs_leave_the_allocator_peak_empty(monkeypatch, results_dir):
    """A CUDA graph replay allocates nothing: the allocator's peak misses the graphs' working memory (a compiled row
    once recorded an own peak below zero). Such rows leave it empty and say why; the own peak stays, with the graphs'
    pools added (tests/test_memory.py); other rows keep both."""
    from harness.measure import memory

    assert memory.graph_blind({"compiled": True, "compile_mode": "max-autotune"}) == ("mem_peak_allocated_bytes",)
    assert memory.graph_blind({"compiled": True, "compile_mode": "max-autotune-no-cudagraphs"}) == ()
    assert memory.graph_blind({"compiled": False, "compile_mode": "max-autotune"}) == ()
    use_fake_backends(monkeypatch, FAKES)
    df = run_here(monkeypatch, cpu_cfg(results_dir, "ep_size=1", "backends=[replays_graphs,nccl]"))
    graphed, nccl = _rows(df, "replays_graphs"), _rows(df, "nccl")
    assert list(graphed["status"]) == ["ok", "ok"] and list(nccl["status"]) == ["ok", "ok"]
    assert graphed["notes"].str.contains("replays CUDA graphs", regex=False).all()
    assert not nccl["notes"].fillna("").str.contains("replays CUDA graphs", regex=False).any()


def test_own_process_names_backends_of_the_run(results_dir):
    from harness.core.errors import ConfigError

    with pytest.raises(ConfigError, match="own_process names sonicmoe"):
        runner.prepare(cpu_cfg(results_dir, "backends=[nccl]", "own_process=[sonicmoe]"))
    with pytest.raises(ConfigError, match="add nccl to own_process"):
        runner.prepare(cpu_cfg(results_dir, "backends=[nccl]", f"+own_pythonpath.nccl={results_dir.parent}"))


@pytest.mark.slow
def test_own_pythonpath_reaches_only_its_backends_processes(monkeypatch, results_dir, tmp_path):
    """A backend whose package lives in a folder of its own (own_pythonpath) imports there, in its own processes; the
    same backend without it is an unsupported row (its module is not on the path)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "planted_pkg.py").write_text("from baselines.nccl import NcclBackend\n\n\n"
                                         "class Planted(NcclBackend):\n    name = 'planted'\n")
    use_fake_backends(monkeypatch, "planted=planted_pkg:Planted")
    df = runner.run_benchmark(cpu_cfg(results_dir, "ep_size=2", "backends=[nccl,planted]", "own_process=[planted]",
                                      f"+own_pythonpath.planted={site}"))
    planted = _rows(df, "planted")
    assert list(planted["status"]) == ["ok", "ok"], planted[["status", "error"]]
    assert planted["notes"].str.contains("processes of its own").all()
    bare = runner.run_benchmark(cpu_cfg(tmp_path / "bare", "ep_size=2", "backends=[planted]"))
    assert (bare["status"] == "unsupported").all() and bare["error"].str.contains("planted_pkg").all()
