"""Run display names (harness.core.run_names): the committed table, its derivation, and new runs' default ids."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.core import results  # noqa: E402
from harness.core import run_names as N  # noqa: E402


def test_the_committed_table_is_the_derived_one():
    """results/runs/names.csv is what ``python -m harness.core.run_names`` derives from the committed rows."""
    assert N.main(["--check"]) == 0


def test_every_committed_run_has_one_name_of_the_form_and_no_two_share_one():
    names = N.load_names()
    run_ids = set(results.load(results.REFERENCE_RUNS)["run_id"].dropna().astype(str))
    assert {r for r in run_ids if not N.NAME_FORM.fullmatch(r)} == set(names)
    shown = [N.display_name(r) for r in run_ids]
    assert len(set(shown)) == len(run_ids)
    assert all(N.NAME_FORM.fullmatch(n) for n in names.values()), [n for n in names.values()
                                                                      if not N.NAME_FORM.fullmatch(n)]
    assert all(N.run_id_of(n) == r for r, n in names.items())


def test_the_names_table_is_no_results_file():
    files, skipped = results.find_files(results.REFERENCE_RUNS)
    assert results.REFERENCE_RUNS / results.RUN_NAMES not in files
    assert not any(results.RUN_NAMES in str(f) for fs in skipped.values() for f in fs)


def test_hardware_and_what():
    assert N.hardware("NVIDIA H200", 2) == "h200x2"
    assert N.hardware("NVIDIA H100 80GB HBM3", 1) == "h100x1"
    assert N.hardware("NVIDIA GB300", 4) == "gb300x4"
    assert N.hardware("cpu", 2) == "cpu"
    assert N.what(["nccl", "mok_hopper"], ["fp8"], ["bwd", "fwd"], ["glm_5_2@16epg"]) == \
        "mok_hopper-fp8-fwd-bwd-glm_5_2-16epg"
    assert N.what(["deepep", "nccl"], ["bf16"], ["fwd"], ["a", "b"]) == "baselines-bf16-fwd"
    assert N.what(["nccl"], ["bf16", "fp8"], ["fwd"]) == "nccl-bf16-fp8-fwd"


def _rows(run_id: str, t: str, **kw) -> dict:
    return {"run_id": run_id, "timestamp": t, "backend": "mok_hopper", "precision": "bf16", "direction": "fwd",
            "shape": "tiny", "device": "cuda", "gpu_name": "NVIDIA H200", "num_gpus": 1, **kw}


def test_two_runs_that_would_share_a_name_are_told_apart_in_the_order_they_started():
    df = pd.DataFrame([_rows("later", "2026-12-04T12:00:00+00:00"), _rows("first", "2026-12-04T08:00:00+00:00"),
                       _rows("third", "2026-12-04T13:00:00+00:00", num_gpus=2),
                       _rows("x_h200x1_20261201", "2026-12-01T00:00:00+00:00")])
    assert N.derive_names(df) == {"first": "mok_hopper-bf16-fwd-tiny_h200x1_20261204",
                                  "later": "mok_hopper-bf16-fwd-tiny_h200x1_20261204-2",
                                  "third": "mok_hopper-bf16-fwd-tiny_h200x2_20261204"}
    # a run id of the form keeps its name, and no other run takes it
    taken = pd.DataFrame([_rows("mok_hopper-bf16-fwd-tiny_h200x1_20261204", "2026-12-04T09:00:00+00:00"),
                          _rows("old", "2026-12-04T08:00:00+00:00")])
    assert N.derive_names(taken) == {"old": "mok_hopper-bf16-fwd-tiny_h200x1_20261204-2"}


def test_a_run_without_a_name_is_shown_by_its_id(tmp_path, monkeypatch):
    (tmp_path / results.RUN_NAMES).write_text("run_id,name\nold-id,new_h200x1_20261204\n")
    monkeypatch.setattr(results, "REFERENCE_RUNS", tmp_path)
    assert N.display_name("old-id") == "new_h200x1_20261204"
    assert N.display_name("unknown") == "unknown"
    assert N.run_id_of("new_h200x1_20261204") == "old-id"


def test_a_new_run_gets_what_where_and_when_by_default():
    c = {"device": "cuda", "backends": ["nccl", "mok_hopper"], "precision": {"name": "fp8"},
         "directions": ["fwd"], "shape": {"name": "kimi_k2_7"}}
    rid = N.default_run_id(c, 2, "NVIDIA H200", pd.Timestamp("2026-12-07T15:04:22", tz="UTC"))
    assert rid.startswith("mok_hopper-fp8-fwd-kimi_k2_7_h200x2_20261207-150422-")
    assert N.NAME_FORM.fullmatch(rid)
    cpu = N.default_run_id({**c, "device": "cpu"}, 2, None, pd.Timestamp("2026-12-07T15:04:22", tz="UTC"))
    assert cpu.startswith("mok_hopper-fp8-fwd-kimi_k2_7_cpu_20261207-150422-")
    assert N.default_run_id(c, 1, "NVIDIA H200") != N.default_run_id(c, 1, "NVIDIA H200")


def test_the_runner_names_a_run_without_an_id(monkeypatch):
    """``runner.new_run_id``: the GPUs a run uses (ranks over ranks per GPU), the model from nvidia-smi; a name the
    run-id check takes."""
    from harness.measure import runner
    from harness.config.validate import check_run_id

    import dataclasses

    from conftest import compose_cfg
    from harness.config.point import resolve

    c = resolve(compose_cfg("device=cpu", "shape=tiny", "backends=[nccl]", "directions=[fwd,bwd]"))
    rid = runner.new_run_id(c, 2)
    assert rid.startswith("nccl-bf16-fwd-bwd-tiny_cpu_") and N.NAME_FORM.fullmatch(rid)
    check_run_id(rid)
    monkeypatch.setattr(runner, "gpu_model", lambda device: "NVIDIA H200" if device == "cuda" else None)
    assert "_h200x2_" in runner.new_run_id(dataclasses.replace(c, device="cuda", ranks_per_gpu=2), 4)


def test_a_sweep_without_a_run_id_is_named_by_its_hardware_and_its_folder_s_time(monkeypatch):
    """The jobs of a sweep share one run id, made in each job alike: the machine's GPUs (model and count) and the
    time in the sweep folder's name."""
    from harness.core import run_names

    monkeypatch.setattr(run_names, "_gpu_names", lambda device: ["NVIDIA H100 80GB HBM3"] * 8)
    assert run_names.sweep_run_id("auto", "multirun/2026-12-07/19-30-05") == "sweep_h100x8_20261207-193005"
    assert run_names.sweep_run_id("cuda", "/tmp/x/my-sweep") == "sweep_h100x8_tmpxmysweep"
    assert run_names.sweep_run_id("cpu", "multirun/2026-12-07/19-30-05") == "sweep_cpu_20261207-193005"
    monkeypatch.setattr(run_names, "_gpu_names", lambda device: [])
    assert run_names.sweep_run_id("auto", "multirun/2026-12-07/19-30-05") == "sweep_cpu_20261207-193005"
    assert run_names.sweep_run_id("cuda", "multirun/2026-12-07/19-30-05") == "sweep_gpu_20261207-193005"
