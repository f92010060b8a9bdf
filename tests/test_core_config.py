"""Config composition, validation and the published formulas (no ranks started)."""

from __future__ import annotations

import pytest
from conftest import compose_cfg

from harness.config.schema import COMPILE_MODES, Case, ConfigError, to_container
from harness.config.point import make_case
from harness.config.validate import check_option_conflicts
from harness.config.point import resolve

PUBLISHED = {  # docs/methodology.md section 1: experts, H, I, topk, local experts at EP64
    "kimi_k2_7": (384, 7168, 2048, 8, 6),
    "glm_5_2": (256, 6144, 2048, 8, 4),
    "qwen3_5_397b": (512, 4096, 1024, 10, 8),
    "deepseek_v4_pro": (384, 7168, 3072, 6, 6),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_shapes(name):
    c = to_container(compose_cfg(f"shape={name}").shape)
    e, h, i, k, epg = PUBLISHED[name]
    assert (c["num_experts"], c["hidden"], c["ffn"], c["topk"]) == (e, h, i, k)
    assert c["shared_expert"] is True and c["published_local_experts"] == epg


def test_published_flops_per_forward():
    # docs/methodology.md section 6: FLOP per GPU per forward at T=2048.
    want = {"kimi_k2_7": 1.623e12, "glm_5_2": 1.392e12, "qwen3_5_397b": 0.567e12, "deepseek_v4_pro": 1.894e12}
    for name, flops in want.items():
        case = make_case(resolve(compose_cfg(f"shape={name}", "device=cpu")), ep_size=64, device="cpu")
        assert case.flops("fwd") == pytest.approx(flops, rel=2e-3)
        assert case.flops("bwd") == 2 * case.flops("fwd")
        assert case.flops("fwd_bwd") == 3 * case.flops("fwd")


def test_flops_without_shared_expert_drops_the_T_term():
    c = resolve(compose_cfg("device=cpu", "shape=tiny", "shape.shared_expert=false"))
    case = make_case(c, ep_size=2, device="cpu")
    assert case.flops("fwd") == 6 * case.tokens_per_gpu * case.topk * case.hidden * case.ffn


def test_cpu_default_resolves_to_tiny_and_quick():
    c = resolve(compose_cfg("device=cpu"))
    assert c.shape.name == "tiny" and c.timing.name == "quick"
    assert c.backends == ["nccl"] and c.directions == ["fwd", "bwd"]


def test_auto_timing_on_a_gpu_machine_is_the_published_preset(monkeypatch):
    """``timing: auto`` resolves to the machine's preset with its own counts: on a GPU the published 500 / 100
    (it used to keep the schema's quick defaults, 2 / 5, under the name ``published``), and a count set on the
    command line is kept."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    t = resolve(compose_cfg("device=cuda")).timing
    assert (t.name, t.num_warmup, t.num_iters, t.phase_iters) == ("published", 500, 100, 50)
    t = resolve(compose_cfg("device=cuda", "timing.num_iters=30")).timing
    assert (t.name, t.num_warmup, t.num_iters) == ("custom", 500, 30)  # not the published 500 / 100
    t = resolve(compose_cfg("device=cpu")).timing
    assert (t.name, t.num_warmup, t.num_iters, t.phase_iters) == ("quick", 2, 5, 5)


def test_published_timing_preset():
    t = to_container(compose_cfg("timing=published").timing)
    assert (t["num_warmup"], t["num_iters"], t["l2_flush"], t["align"]) == (500, 100, False, "barrier")


def test_timing_preset_names_only_the_timing_it_stands_for():
    t = resolve(compose_cfg("device=cpu", "timing=published")).timing
    assert (t.name, t.num_warmup, t.num_iters) == ("published", 500, 100)
    for extra in (["timing.num_warmup=20", "timing.num_iters=50"], ["timing.num_iters=50"], ["timing.l2_flush=true"]):
        assert resolve(compose_cfg("device=cpu", "timing=published", *extra)).timing.name == "custom"
    assert resolve(compose_cfg("device=cpu", "timing=published", "timing.phase_iters=5")).timing.name == \
        "published"  # phase_iters times only the per-phase bandwidth columns
    t = resolve(compose_cfg("device=cpu")).timing  # timing=auto on a CPU: quick, all of it
    assert (t.name, t.num_warmup, t.num_iters, t.phase_iters) == ("quick", 2, 5, 5)
    assert resolve(compose_cfg("device=cpu", "timing.num_iters=7")).timing.name == "custom"


def test_local_experts_option_sets_experts_per_gpu():
    c = resolve(compose_cfg("device=cpu", "shape=kimi_k2_7", "shape.local_experts=6"))
    case = make_case(c, ep_size=2, device="cpu")
    assert (case.num_experts, case.local_experts, case.experts_override) == (12, 6, True)
    assert (case.hidden, case.ffn, case.topk) == (7168, 2048, 8)
    assert case.shape == "kimi_k2_7@6epg"


def test_backend_and_direction_groups():
    c = to_container(compose_cfg("backend=reference", "direction=fwd_bwd"))
    assert c["backends"] == ["reference"] and c["directions"] == ["fwd_bwd"]
    c = to_container(compose_cfg("backends=[nccl,reference]", "directions=[bwd]"))
    assert c["backends"] == ["nccl", "reference"] and c["directions"] == ["bwd"]


# Command lines that pick a group option and set the key it sets: accepted where both say the same (or the option is
# the default one, not given), refused where the key would silently replace the option.
AGREEING = [["backend=nccl", "backends=[nccl]"], ["backends=[nccl,deepep]"], ["direction=fwd_and_bwd",
            "directions=[fwd,bwd]"], ["directions=[bwd]"], ["precision=fp8", "precision.name=fp8"],
            ["workload=zipf", "workload.zipf_exponent=1.5"], ["+experiment=hopper_published", "direction=fwd"],
            ["+experiment=hopper_published", "backends=[nccl]"], ["backend=nccl", "direction=fwd", "precision=bf16"]]
CONFLICTING = [
    (["backend=mok_hopper", "backends=[nccl]"], "backend=mok_hopper conflicts with backends=[nccl], which replaces "
                                                "it: give one of the two (backend=mok_hopper alone, or "
                                                "backends=[nccl] alone)"),
    (["direction=fwd", "directions=[bwd]"], "direction=fwd conflicts with directions=[bwd]"),
    (["direction=fwd_and_bwd", "directions=[fwd]"], "direction=fwd_and_bwd conflicts with directions=[fwd]"),
    (["precision=fp8", "precision.name=bf16"], "precision=fp8 conflicts with precision.name=bf16, which replaces it: "
                                               "give one of the two (precision=fp8 alone, or precision=bf16 alone)"),
    (["workload=zipf", "workload.routing=uniform"], "workload=zipf conflicts with workload.routing=uniform"),
    (["+experiment=hopper_published", "backend=nccl"], "backend=nccl conflicts with backends=[nccl,deepep,hybridep,"
                                                       "deepep_te,hybridep_megatron,mok_hopper] (set by "
                                                       "+experiment=hopper_published), which replaces it: drop "
                                                       "backend=nccl"),
]


@pytest.mark.parametrize("overrides", AGREEING, ids=[" ".join(o) for o in AGREEING])
def test_options_that_agree_are_accepted(overrides):
    check_option_conflicts(compose_cfg(*overrides), overrides)


@pytest.mark.parametrize("overrides,message", CONFLICTING, ids=[" ".join(o) for o, _ in CONFLICTING])
def test_an_option_and_a_key_that_replaces_it_are_refused(overrides, message):
    with pytest.raises(ConfigError) as e:
        check_option_conflicts(compose_cfg(*overrides), overrides)
    assert message in str(e.value)


BAD = [
    (["backends=[nope]"], "unknown backend 'nope'"),
    (["directions=[sideways]"], "unknown direction 'sideways'"),
    (["precision.name=fp4"], "unknown precision 'fp4'"),
    (["shape=tiny", "shape.num_experts=6"], "not divisible by ep_size=4"),
    (["shape=tiny", "shape.topk=9"], "topk=9 exceeds num_experts=8"),
    (["shape=tiny", "precision=fp8", "shape.hidden=200"], "divisible by the scale blocks"),
    (["workload=hot_rank", "workload.hot_rank=7"], "hot_rank=7 is not a rank of ep_size=4"),
    (["workload.routing=skewed"], "unknown workload.routing 'skewed'"),
    (["workload.tokens_per_gpu=0"], "tokens_per_gpu must be >= 1"),
    (["timing.num_iters=0"], "timing.num_iters must be >= 1 (got 0)"),
    (["backend_order=random"], "unknown backend_order 'random'; choose one of: given, reverse, shuffle"),
    (["setup_timeout_s=0"], "setup_timeout_s must be > 0 and <= 31536000 seconds, or null for no limit (got 0"),
    # every numeric option with a value that can never work, with its valid range
    (["dist_timeout_s=0"], "dist_timeout_s must be between 1 and 31536000 seconds (got 0)"),
    (["dist_timeout_s=-5"], "dist_timeout_s must be between 1 and 31536000 seconds (got -5)"),
    (["dist_timeout_s=100000000000000"], "dist_timeout_s must be between 1 and 31536000 seconds"),
    (["setup_timeout_s=-1"], "setup_timeout_s must be > 0"),
    (["setup_timeout_s=inf"], "setup_timeout_s must be > 0 and <= 31536000 seconds"),
    (["timing.num_warmup=-1"], "timing.num_warmup must be >= 0 (got -1)"),
    (["timing.phase_iters=-1"], "timing.phase_iters must be >= 0 (0: no per-phase bandwidth timing) (got -1)"),
    (["timing=quick", "timing.num_iters=null"], "timing.num_iters is not set"),
    (["timing=quick", "timing.l2_flush=null"], "timing.l2_flush is not set"),
    (["ep_size=0"], "ep_size must be >= 1, or null for all local GPUs (2 ranks on a CPU) (got 0)"),
    (["workload.seed=9999999999"], "workload.seed must be between -2147483648 and 2147483647"),
    (["precision=fp8", "precision.act_block=0"], "precision.act_block must be >= 1 (got 0)"),
    (["precision.weight_block=-128"], "precision.weight_block must be >= 1 (got -128)"),
    (["precision.atol=-1"], "precision.atol must be >= 0 (got -1.0)"),
    (["precision.rtol=nan"], "precision.rtol must be >= 0 (got nan)"),
    (["comm_sms=0"], "comm_sms must be a positive even number (got 0)"),
    (["workload.tokens_per_gpu=-1"], "tokens_per_gpu must be >= 1 (got -1)"),
    (["compile_mode=fast"], "unknown compile_mode 'fast'; choose one of: default, reduce-overhead, max-autotune, "
                            "max-autotune-no-cudagraphs, published"),
    (["run_id=../../escape"], "run_id=../../escape is not a run name"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[m for _, m in BAD])
def test_invalid_configs_name_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        c = resolve(compose_cfg("device=cpu", "shape=tiny", *overrides))
        make_case(c, ep_size=4, device="cpu")


def test_cuda_requested_without_gpu_is_a_config_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the no-GPU message cannot be provoked")
    with pytest.raises(ConfigError, match="no CUDA GPU is visible"):
        resolve(compose_cfg("device=cuda"))


def test_routing_labels():
    base = dict(shape="s", num_experts=8, local_experts=4, hidden=256, ffn=128, topk=2, shared_expert=True,
                swiglu_limit=None, experts_override=False, published_local_experts=None, tokens_per_gpu=8, seed=1,
                zipf_exponent=1.2, hot_fraction=0.25, hot_ratio=3.0, hot_rank=1, precision="bf16", act_block=128,
                weight_block=128, atol=0.5, rtol=0.01, ep_size=2, device="cpu", compile=False, compile_mode="",
                comm_sms=None)
    from harness.config.routing import label

    assert label(Case(routing="uniform", **base)) == "uniform"
    assert label(Case(routing="zipf", **base)) == "zipf(s=1.2)"
    assert label(Case(routing="hot_experts", **base)) == "hot_experts(f=0.25,x3)"
    assert label(Case(routing="hot_rank", **base)) == "hot_rank(r=1,x3)"
    assert label(Case(routing="zipf", routing_steps=16, **base)) == "zipf(s=1.2)+16steps"


@pytest.mark.parametrize("compile_", ["true", "false", "null"])
def test_unknown_compile_mode_is_refused_before_anything_runs(compile_):
    """compile_mode is checked whether or not this machine compiles (a CPU run does not, by default): it is recorded
    and swept, and the same command must not be accepted on a CPU and refused on a GPU."""
    with pytest.raises(ConfigError, match="unknown compile_mode 'fast'.*published"):
        resolve(compose_cfg("device=cpu", f"compile={compile_}", "compile_mode=fast"))
    for mode in COMPILE_MODES:
        resolve(compose_cfg("device=cpu", f"compile={compile_}", f"compile_mode={mode}"))


def test_compile_mode_published_is_each_backends_own():
    """``compile_mode=published``: nccl compiles as bench_nccl_torch.py (max-autotune), the DeepEP-based PyTorch
    baselines as bench_deepep_torch.py (max-autotune-no-cudagraphs); the row records the mode used."""
    import types

    import torch

    from baselines.common import ExpertParams
    from baselines.nccl import NcclBackend
    from baselines.options import ExpertGemmOptions

    case = types.SimpleNamespace(compile=True, compile_mode="published", shared_expert=False, precision="bf16",
                                 ffn=4)
    inputs = types.SimpleNamespace(w13_LIH=torch.zeros(2, 8, 4), w2_LHI=torch.zeros(2, 4, 4))
    nccl = object.__new__(NcclBackend)
    # what __init__ sets (group: the process group, unused here)
    nccl.case, nccl.group, nccl.options = case, None, ExpertGemmOptions()
    nccl.warm_compile = lambda inputs: None  # the compile itself (and its fallback): tests/test_torch_native.py
    nccl.setup(inputs)
    assert nccl.params.columns()["compile_mode"] == "max-autotune"
    assert ExpertParams(case, inputs).columns()["compile_mode"] == "max-autotune-no-cudagraphs"  # deepep, hybridep
    case.compile_mode = "default"
    nccl.setup(inputs)
    assert nccl.params.columns()["compile_mode"] == "default"
    case.compile = False
    assert ExpertParams(case, inputs).columns() == {"scaling": "none", "compiled": False, "compile_mode": ""}


def test_compiled_experts_mark_their_weights_static():
    """Under torch.compile the weights are static inputs, like a module's parameters: max-autotune's CUDA graphs
    then read them in place. Unmarked, every call copied all expert weights into the graph (2x the nccl forward)."""
    import types

    import torch

    from baselines.common import ExpertParams

    def static(t):  # what torch._dynamo.mark_static_address sets (read by dynamo and the CUDA graph trees)
        return getattr(t, "_dynamo_static_input_type", None) is not None

    inputs = types.SimpleNamespace(w13_LIH=torch.randn(2, 256, 128), w2_LHI=torch.randn(2, 128, 128),
                                   ws_gate_IH=torch.randn(128, 128), ws_up_IH=torch.randn(128, 128),
                                   ws_down_HI=torch.randn(128, 128))
    for precision in ("bf16", "fp8"):
        case = types.SimpleNamespace(compile=True, compile_mode="published", shared_expert=True, ffn=128,
                                     precision=precision, weight_block=128)
        p = ExpertParams(case, inputs)
        weights = [p.w13, p.w2, *p.shared, *(p._quantized or [])]
        assert len(weights) == (7 if precision == "fp8" else 5) and all(static(t) for t in weights)
    case.compile = False
    assert not any(static(t) for t in (ExpertParams(case, inputs).w13, ExpertParams(case, inputs).w2))


def test_fp8_weights_are_used_as_prequantized_with_a_straight_through_gradient():
    """The emulated-fp8 baselines' GEMMs read the dequantized e4m3 weights computed once: no per-call arithmetic on
    the weights (a view of them, the same storage), and the master weight gets the gradient unchanged."""
    import torch

    from baselines.common import straight_through

    w = torch.randn(4, 8, requires_grad=True)
    q = (w.detach() * 16).round() / 16
    y = straight_through(w, q)
    assert torch.equal(y, q) and y.data_ptr() == q.data_ptr()
    g = torch.randn(4, 8)
    (y * g).sum().backward()
    assert torch.equal(w.grad, g)


def test_backend_order():
    from harness.config.schema import backend_order

    b = ["nccl", "deepep", "hybridep", "mok_hopper"]
    assert backend_order(b, "given", 1) == b and backend_order(b, "reverse", 1) == b[::-1]
    s1, s2 = backend_order(b, "shuffle", 1), backend_order(b, "shuffle", 1)
    assert s1 == s2 and sorted(s1) == sorted(b)  # the same on every rank for one seed
    assert any(backend_order(b, "shuffle", seed) != b for seed in range(5))


def test_shape_table_is_the_one_order_of_shapes():
    """configs/shape/*.yaml order and label the shapes: the report's order and the benchmark tools' published shapes
    both come from harness.config.schema.shape_table."""
    from mok_tools.shapes import published_shapes
    from harness.config.schema import shape_table
    from harness.report.labels import SHAPE_LABELS, SHAPE_ORDER, shape_label

    table = shape_table()
    assert "auto" not in table and "custom" not in table and "tiny" in table
    assert SHAPE_ORDER == ("kimi_k2_7", "glm_5_2", "qwen3_5_397b", "deepseek_v4_pro")
    assert list(table)[:4] == list(SHAPE_ORDER) and published_shapes() == list(SHAPE_ORDER)
    assert shape_label("glm_5_2@8epg") == "GLM 5.2 @8epg" and shape_label("tiny") == "tiny"
    assert set(SHAPE_LABELS) == set(PUBLISHED)


def test_a_new_shape_file_joins_the_report_order(tmp_path):
    """A shape added as one YAML file (with a display_order) takes its place in the report's tables and charts."""
    import os
    import shutil
    import subprocess
    import sys

    from conftest import ROOT

    configs = tmp_path / "configs"
    shutil.copytree(ROOT / "configs", configs)
    (configs / "shape" / "my_moe.yaml").write_text(
        "defaults:\n  - base_shape\nname: my_moe\nnum_experts: 64\nhidden: 2048\nffn: 768\ntopk: 4\n"
        "display_order: 0\nlabel: My MoE\n")
    code = f"""
import harness.config.schema as C
C.CONFIG_DIR = __import__("pathlib").Path({str(configs)!r})
from harness.report import labels, claims, plots
import pandas as pd
print(",".join(labels.SHAPE_ORDER), labels.shape_label("my_moe@2epg"), sep="|")
t = pd.DataFrame({{"shape": ["glm_5_2", "tiny", "my_moe", "kimi_k2_7"]}})
print(",".join(labels.in_order(t["shape"], labels.SHAPE_ORDER)))
"""
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "my_moe,kimi_k2_7,glm_5_2,qwen3_5_397b,deepseek_v4_pro|My MoE @2epg"
    assert out[1] == "my_moe,kimi_k2_7,glm_5_2,tiny"


def test_how_a_shape_is_shown_is_not_in_its_config_hash():
    from harness.config.schema import config_hash

    c = to_container(resolve(compose_cfg("shape=kimi_k2_7", "device=cpu")))
    case = make_case(c, ep_size=2, device="cpu")
    relabelled = dict(c, shape=dict(c["shape"], display_order=9, label="renamed"))
    unlabelled = dict(c, shape={k: v for k, v in c["shape"].items() if k not in ("display_order", "label")})
    assert config_hash(c, case) == config_hash(relabelled, case) == config_hash(unlabelled, case)
    assert config_hash(c, case) != config_hash(dict(c, shape=dict(c["shape"], hidden=4096)), case)


def test_a_composed_config_survives_the_pickle_to_a_sweep_job_and_back(tmp_path):
    """submitit cloudpickles each job's config and Hydra's return of it: the schema's class must travel by reference
    (a copied dataclass loses dataclasses.MISSING, and OmegaConf then refused `backends` in the Slurm launcher)."""
    import subprocess
    import sys

    import cloudpickle

    (tmp_path / "cfg.pkl").write_bytes(cloudpickle.dumps(compose_cfg("shape=tiny", "device=cpu")))
    code = ("import pickle, sys; from omegaconf import OmegaConf\n"
            f"cfg = pickle.load(open({str(tmp_path / 'cfg.pkl')!r}, 'rb'))\n"
            "cls = cfg._metadata.object_type\n"
            "OmegaConf.structured(cls); print(cls.__module__, cls.__qualname__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["harness.config.schema", "MokbenchConfig"]
