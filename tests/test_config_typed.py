"""The configuration is typed once and checked once: the composed config becomes the typed configuration in
``harness.config.point.resolve`` and a :class:`~harness.config.point.Point` once per process, every check of a point
takes it (or its typed parts), and the ranks get the point itself."""

from __future__ import annotations

import inspect
import pickle
import typing

import pytest
from conftest import compose_cfg, cpu_cfg, run_here
from omegaconf import DictConfig

import harness.config.point as point_mod
import harness.config.validate as validate
import harness.measure.runner as runner
from contract.case import Case
from harness.config.point import Point, resolve
from harness.config.schema import BenchConfig, PrecisionConfig, ShapeConfig, TimingConfig

TYPED = (BenchConfig, ShapeConfig, PrecisionConfig, TimingConfig, Case, Point)

# The functions of harness/config/validate.py that do not take a point, and what they take instead: each named here
# with the annotation of its first parameter, so that a check moved off the typed point fails below.
NOT_OF_A_POINT = {
    "check_complete": dict,  # the composed values before they are typed: what typing needs
    "check_option_conflicts": DictConfig,  # the composed config against the command line, before it is resolved
    "run_id_for_sweep": DictConfig,  # sets a sweep job's run id in its composed config
    "given_run_id": typing.Any,  # the run id given: of the composed config (sweep checks) or of the typed one
    "check_run_id": typing.Any,  # a run id
    "check_device": str,
    "check_gpus": int,
    "check_launcher_options": dict,  # a launcher's options
}


def _first_parameter_type(fn) -> object:
    name = next(iter(inspect.signature(fn).parameters))
    return typing.get_type_hints(fn).get(name, typing.Any)


def _public_functions(module) -> dict:
    return {n: f for n, f in vars(module).items()
            if inspect.isfunction(f) and f.__module__ == module.__name__ and not n.startswith("_")}


def test_every_check_of_a_point_takes_the_typed_point_or_its_parts():
    checks = _public_functions(validate)
    assert {"validate_run_options", "validate_case", "check_new_run", "check_job_layout", "check_cpu_memory",
            "check_local_experts"} <= checks.keys()
    for name, fn in checks.items():
        got = _first_parameter_type(fn)
        if name in NOT_OF_A_POINT:
            assert got == NOT_OF_A_POINT[name], (name, got)
        else:
            assert got in TYPED, f"harness.config.validate.{name} takes {got}, not the typed point or its parts"
    # the runner's checks of the run id and the run folder, and the rank count
    for fn in (runner.new_run_id, runner._point_of_a_sweep, point_mod.world_size_for):
        assert _first_parameter_type(fn) is BenchConfig, fn.__name__


def _is_whole_config(v) -> bool:
    groups = {"shape", "workload", "precision", "timing"}
    return isinstance(v, BenchConfig) or (isinstance(v, (dict, DictConfig)) and groups <= set(v.keys()))


@pytest.fixture
def conversions(monkeypatch):
    """Counts of what changes the configuration's form in this process: ``Point.build``, ``typed_config``,
    ``Point.as_dict`` and ``to_container`` of a whole configuration (where any module imported it)."""
    import sys

    from harness.config import schema

    counts = {"build": 0, "typed_config": 0, "as_dict": 0, "to_container": 0}
    build, typed_config, as_dict, to_container = (Point.build.__func__, point_mod.typed_config, Point.as_dict,
                                                  schema.to_container)

    def counting_build(cls, *a, **kw):
        counts["build"] += 1
        return build(cls, *a, **kw)

    def counting_typed_config(c):
        counts["typed_config"] += 1
        return typed_config(c)

    def counting_as_dict(self):
        counts["as_dict"] += 1
        return as_dict(self)

    def counting_to_container(cfg):
        counts["to_container"] += _is_whole_config(cfg)
        return to_container(cfg)

    monkeypatch.setattr(Point, "build", classmethod(counting_build))
    monkeypatch.setattr(point_mod, "typed_config", counting_typed_config)
    monkeypatch.setattr(Point, "as_dict", counting_as_dict)
    for m in list(sys.modules.values()):
        if getattr(m, "__name__", "").startswith("harness") and getattr(m, "to_container", None) is to_container:
            monkeypatch.setattr(m, "to_container", counting_to_container)
    return counts


def test_a_run_types_its_configuration_once(results_dir, monkeypatch, conversions):
    """One run with the worker in this process (as under torchrun): the composed config becomes plain values once
    (for the ``auto`` choices), the typed configuration once and the point once; nothing turns it back into a dict
    and builds it again (the rank reads the point the checks read)."""
    df = run_here(monkeypatch, cpu_cfg(results_dir, "backends=[nccl]", "directions=[fwd]"))
    assert list(df.status) == ["ok"]
    assert conversions == {"build": 1, "typed_config": 1, "as_dict": 0, "to_container": 1}


def test_spawned_ranks_get_the_point_itself(results_dir, monkeypatch, conversions):
    """The launching process hands its ranks the point it checked (pickled by torch's spawn), no configuration to
    build again; the point comes back from a pickle, and from cloudpickle (submitit's), equal."""
    handed = []
    run_ranks = runner._run_ranks

    def keep(payload, *a, **kw):
        handed.append(payload)
        return run_ranks(payload, *a, **kw)

    monkeypatch.setattr(runner, "_run_ranks", keep)
    df = runner.run_benchmark(cpu_cfg(results_dir, "ep_size=2", "backends=[nccl]", "directions=[fwd]"))
    assert list(df.status) == ["ok"]
    (payload,) = handed
    pt = payload["point"]
    assert isinstance(pt, Point) and not any(_is_whole_config(v) for v in payload.values())
    assert conversions == {"build": 1, "typed_config": 1, "as_dict": 0, "to_container": 1}
    back = pickle.loads(pickle.dumps(payload))["point"]
    assert back == pt and type(back.config) is type(pt.config)
    cloudpickle = pytest.importorskip("cloudpickle", reason="submitit's pickler, installed with submitit")
    assert cloudpickle.loads(cloudpickle.dumps(pt)) == pt


def test_the_typed_configuration_is_the_checked_one():
    """``resolve`` gives the typed configuration with the aliases moved into the backends' options, and the point
    built from it keeps that very object."""
    config = resolve(compose_cfg("device=cpu", "shape=tiny", "precision=fp8", "fp8_gemm=rowwise"))
    assert isinstance(config, BenchConfig) and config.fp8_gemm is None and config.nccl.fp8_gemm == "rowwise"
    pt = Point.build(config, ep_size=2, device="cpu")
    assert pt.config is config and pt.options("nccl").fp8_gemm == "rowwise"
