"""The routing models' table (harness/config/routing.py): one class and one YAML preset each, a planted model that runs,
the Megatron-LM W0-W7 presets, incast, the per-step routings and their rows, and the points' hashes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import ROOT, compose_cfg, cpu_cfg, run_here, use_fake_backends
from omegaconf import OmegaConf

from harness.config import routing
from harness.config.schema import ConfigError, rebuild_schemas
from harness.measure.inputs import make_inputs
from harness.config.point import Point
from harness.config.routing_models import RoutingModel, generator, unit_gates
from harness.config.point import resolve
from harness.measure.runner import run_benchmark

T = 256  # tokens per rank: enough for the shares below to be within a few percent
WIDE = "shape.local_experts=16"


def point(*overrides: str, ep: int = 2) -> Point:
    return Point.build(resolve(compose_cfg("device=cpu", "shape=tiny", f"workload.tokens_per_gpu={T}", *overrides)),
                       ep_size=ep, device="cpu")


def ids(case, step: int = 0, ranks=None) -> torch.Tensor:
    return torch.cat([routing.make_routing(case, r, step)[0] for r in (ranks or range(case.ep_size))])


def share(idx: torch.Tensor, experts) -> float:
    return float(torch.isin(idx, torch.tensor(list(experts))).double().mean())


def test_every_model_has_a_preset_and_every_preset_a_model():
    presets = {p.stem: OmegaConf.load(p).routing for p in (ROOT / "configs" / "workload").glob("*.yaml")}
    assert set(presets.values()) == set(routing.MODELS), presets
    assert {f"megatron_w{i}" for i in range(8)} <= set(presets) and {"rotating", "burst", "incast"} <= set(presets)


# trace needs a trace folder: tests/test_routing_trace.py replays one per step
@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "configs" / "workload").glob("*.yaml")
                                        if p.stem not in ("megatron_w4", "burst", "trace")))
def test_step_zero_is_the_inputs_routing_and_later_steps_differ(name):
    """Every preset at EP 2: the inputs hold step 0's routing, ids are experts, weights sum to 1 per token, and the
    next step is another draw (round_robin: shifted)."""
    case = point(f"workload={name}", "workload.steps=2").case
    inp = make_inputs(case, 1, torch.device("cpu"))
    idx0, w0 = routing.make_routing(case, 1, 0)
    assert torch.equal(inp.topk_idx_TK, idx0) and torch.equal(inp.topk_w_TK, w0)
    assert idx0.min() >= 0 and idx0.max() < case.num_experts
    assert torch.allclose(w0.sum(-1), torch.ones(T)) and (idx0.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct
    assert not torch.equal(routing.make_routing(case, 1, 1)[0], idx0)


def test_megatron_w0_is_exactly_balanced_and_w1_w2_differ_only_in_seed():
    w0 = point("workload=megatron_w0").case
    assert routing.load_stats(ids(w0), w0) == {"expert_load_max_over_mean": 1.0, "rank_load_max_over_mean": 1.0,
                                                "empty_experts": 0}
    # 32 experts (16 a rank): top-2 draws without replacement barely bend the share of an 8-expert block
    w1, w2 = point("workload=megatron_w1", WIDE), point("workload=megatron_w2", WIDE)
    assert routing.label(w1.case) == routing.label(w2.case) == "hot_set(block,f=0.25,share=0.75)"
    assert w1.case.seed != w2.case.seed and w1.config_hash != w2.config_hash
    for c in (w1.case, w2.case):  # experts 0-7 (a quarter of 32) take 3/4 of the slots
        assert share(ids(c), range(8)) == pytest.approx(0.75, abs=0.04)
    assert not torch.equal(ids(w1.case), ids(w2.case))


def test_megatron_w3_w5_and_w4():
    w3 = point("workload=megatron_w3", WIDE).case
    assert share(ids(w3), range(0, 32, 2)) == pytest.approx(0.75, abs=0.04)
    w5 = point("workload=megatron_w5").case
    assert share(ids(w5), range(4)) == 1.0 and routing.load_stats(ids(w5), w5)["empty_experts"] == 4
    w4 = point("workload=megatron_w4").case
    assert "tokens_per_gpu" in routing.unsupported(w4)


def test_megatron_w6_window_moves_every_three_steps():
    c = point("workload=megatron_w6", "workload.steps=6", WIDE).case
    for s in range(6):  # window [0, 8) for steps 0-2, [8, 16) for 3-5
        hot = range(0, 8) if s < 3 else range(8, 16)
        assert share(ids(c, s), hot) == pytest.approx(0.75, abs=0.05), s


def test_megatron_w7_bursts_on_every_fourth_step_on_even_tokens():
    c = point("workload=megatron_w7", "workload.steps=8").case
    for s in range(8):
        idx = routing.make_routing(c, 0, s)[0]
        if s % 4 == 0:
            assert share(idx[0::2], range(2)) == 1.0 and share(idx[1::2], range(2)) < 0.5, s
        else:
            assert share(idx[0::2], range(2)) < 0.5, s


def test_incast_sends_every_rank_to_k_ranks_and_equals_an_even_draw_at_ep1():
    c = point("workload=incast", "workload.incast_ranks=1").case
    assert share(ids(c), range(c.local_experts)) == 1.0  # both source ranks into rank 0's experts
    assert torch.equal(ids(c), ids(point("workload=megatron_w5").case))  # the same draw as W5 at EP 2 (docs say so)
    one = point("workload=incast", ep=1).case
    assert routing.load_stats(ids(one), one)["empty_experts"] == 0
    with pytest.raises(ConfigError, match="incast_ranks=3 is not a number of ranks of ep_size=2"):
        point("workload=incast", "workload.incast_ranks=3")


def test_new_parameters_enter_the_hash_only_off_their_default():
    base = point("workload=uniform").config_hash
    assert point("workload=uniform", "workload.steps=1").config_hash == base
    assert point("workload=uniform", "workload.hot_share=0.75", "workload.rotate_period=1").config_hash == base
    assert point("workload=uniform", "workload.steps=2").config_hash != base
    assert point("workload=uniform", "workload.hot_share=0.5").config_hash != base
    rot = point("workload=rotating").config_hash
    assert point("workload=rotating", "workload.rotate_period=2").config_hash != rot


def test_step_stats_give_median_min_max():
    per = [dict(expert_load_max_over_mean=x, rank_load_max_over_mean=1.0, empty_experts=e)
           for x, e in ((1.0, 0), (3.0, 2), (2.0, 1))]
    got = routing.step_stats(per)
    assert got["expert_load_max_over_mean"] == 2.0 and got["expert_load_max_over_mean_min"] == 1.0
    assert got["expert_load_max_over_mean_max"] == 3.0 and got["empty_experts_max"] == 2
    assert "expert_load_max_over_mean_min" not in routing.step_stats(per[:1])
    assert routing.checked_steps(per, "cpu") == [1, 2, 0] and routing.checked_steps(per, "cuda") == [1, 0]


class Planted(RoutingModel):
    """A planted model: every token's k experts are consecutive from ``planted_first``."""

    name = "planted"
    params = {"planted_first": 0}

    @classmethod
    def label(cls, case):
        return f"planted(first={routing.rm.param(case, 'planted_first')})"

    @classmethod
    def check(cls, case):
        first = routing.rm.param(case, "planted_first")
        if not 0 <= first < case.num_experts:
            raise ConfigError(f"workload.planted_first={first} is not an expert")

    @classmethod
    def route(cls, case, rank, step):
        first = routing.rm.param(case, "planted_first")
        t, k = case.tokens_per_gpu, case.topk
        idx = (first + step + torch.arange(k)).remainder(case.num_experts).expand(t, k).clone()
        return idx, unit_gates(generator(case, rank, step), t, k)


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """The planted class in the table and its YAML preset in a config folder of its own (Hydra's search path)."""
    monkeypatch.setitem(routing.MODELS, "planted", Planted)
    rebuild_schemas()
    (tmp_path / "workload").mkdir()
    (tmp_path / "workload" / "planted.yaml").write_text(
        "defaults:\n  - base_workload\nname: planted\nrouting: planted\nplanted_first: 3\n")
    yield f"hydra.searchpath=[file://{tmp_path}]"
    monkeypatch.delitem(routing.MODELS, "planted")
    rebuild_schemas()


@pytest.mark.slow
def test_a_planted_model_is_one_class_and_one_yaml_and_runs(planted, monkeypatch, results_dir):
    pt = point(planted, "workload=planted", "workload.steps=2", ep=1)
    assert routing.label(pt.case) == "planted(first=3)+2steps" and pt.case.routing_params == (("planted_first", 3),)
    with pytest.raises(ConfigError, match="planted_first=9 is not an expert"):
        point(planted, "workload=planted", "workload.planted_first=9", ep=1)
    # one rank in this process: the planted class is in its table
    df = run_here(monkeypatch, cpu_cfg(results_dir, planted, "ep_size=1", "workload=planted", "workload.steps=2",
                                       f"workload.tokens_per_gpu={T}", "backends=[nccl]"))
    assert list(df.status) == ["ok", "ok"] and (df.routing == "planted(first=3)+2steps").all()
    assert (df.expert_load_max_over_mean == 4.0).all() and (df.empty_experts == 6).all()  # 2 of 8 experts a step
    assert df.latency_step_max_ms.notna().all() and (df.routing_steps == 2).all()


@pytest.mark.slow
def test_the_check_covers_every_routing_step(monkeypatch, results_dir):
    """A backend that keeps the routing it saw at setup passes with one routing and fails the check with several:
    the reference check runs every step's routing (on the CPU), and the timed iterations cycle them."""
    use_fake_backends(monkeypatch, "first_routing=fake_backends:FirstRouting")
    one = run_benchmark(cpu_cfg(results_dir, "ep_size=2", "backends=[first_routing]", "direction=fwd",
                                "run_id=one"))
    assert list(one.status) == ["ok"] and one.latency_step_mean_ms.isna().all() and (one.routing_steps == 1).all()
    many = run_benchmark(cpu_cfg(results_dir, "ep_size=2", "backends=[first_routing,nccl]", "direction=fwd",
                                 "workload=megatron_w7", "workload.steps=4", "timing.num_iters=8", "run_id=many"))
    got = many.set_index("backend")
    assert got.loc["first_routing", "status"] == "mismatch" and "@step" in got.loc["first_routing", "worst_tensor"]
    nccl = got.loc["nccl"]
    assert nccl.status == "ok" and nccl.routing == "burst(f=0.25,every=4)+4steps"
    assert nccl.latency_step_max_ms >= nccl.latency_step_mean_ms > 0
    assert nccl.expert_load_max_over_mean_max > nccl.expert_load_max_over_mean_min  # the burst step stands out
    assert Path(results_dir, "many").is_dir()


def test_a_sweep_point_file_keeps_the_routing_parameters(tmp_path):
    """A Slurm sweep's point file (harness.launch.slurm_plan.write_point / load_point) gives back the Case, new
    parameters and steps included."""
    from harness.launch import slurm_plan as slurm

    pt = point("workload=megatron_w6", "workload.steps=3")
    sp = slurm.Point(num=0, overrides=[], cfg=pt.as_dict(), case=pt.case, config_hash=pt.config_hash, run_id="r",
                     launcher={}, nodes=1, tasks_per_node=2, gpus_per_node=0, world_size=2, job_dir=tmp_path)
    slurm.write_point(sp, {})
    back = slurm.load_point(tmp_path).case
    assert back == pt.case and routing.label(back) == "rotating(f=0.25,share=0.75,every=3)+3steps"


@pytest.mark.slow
def test_megatron_w4_gives_unsupported_rows_with_the_reason(results_dir):
    df = run_benchmark(cpu_cfg(results_dir, "ep_size=2", "workload=megatron_w4", "backends=[nccl,reference]"))
    assert len(df) == 4 and (df.status == "unsupported").all() and df.error.str.contains("tokens_per_gpu").all()
    assert (df.routing == "ragged").all()
