"""End to end on gloo ranks: nccl against the reference, failure rows, the CLI."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT, cpu_cfg, use_fake_backends

from harness.core import results
from harness.measure.runner import run_benchmark

FAKES = ",".join(f"{k}=fake_backends:{v}" for k, v in {
    "wrong": "WrongOutput", "fails_setup": "FailsSetup", "not_installed": "NotInstalled",
    "fwd_only": "ForwardOnly", "dies": "DiesHard", "nan_grad": "NanGrad", "slow_setup": "SlowSetup"}.items())


@pytest.fixture(autouse=True)
def _fake_backends(monkeypatch):
    use_fake_backends(monkeypatch, FAKES)


def by(df, backend, direction):
    sel = df[(df.backend == backend) & (df.direction == direction)]
    assert len(sel) == 1, f"expected one {backend}/{direction} row, got {len(sel)}"
    return sel.iloc[0]


@pytest.fixture(scope="module")
def nccl_run(tmp_path_factory):
    """nccl and the reference at EP ``ep``, every direction: one run an EP size for the module, as (rows, results
    folder); several tests read its rows."""
    runs = {}

    def get(ep: int):
        if ep not in runs:
            d = tmp_path_factory.mktemp(f"nccl_ep{ep}") / "results"
            runs[ep] = (run_benchmark(cpu_cfg(d, f"ep_size={ep}", "backends=[nccl,reference]",
                                              "directions=[fwd,bwd,fwd_bwd]")), d)
        return runs[ep]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("ep", [2, 4])
def test_nccl_matches_reference_output_and_all_gradients(nccl_run, ep):
    df, results_dir = nccl_run(ep)
    assert len(df) == 6
    for d in ("fwd", "bwd", "fwd_bwd"):
        r = by(df, "nccl", d)
        assert r.status == "ok", r.error
        assert r.max_abs_err < 0.5 and r.rel_err < 0.01  # published bf16 tolerances
        # fwd rows are gated on the output, the others on the output and every gradient: bf16 rounding of the
        # gradients differs between the two layers, so a real comparison shows a nonzero error there
        assert r.worst_tensor == "out" if d == "fwd" else (r.rel_err > 0 and r.worst_tensor.startswith("d_"))
        assert r.latency_ms > 0 and r.latency_p20_ms <= r.latency_ms <= r.latency_p80_ms
        assert r.num_iters == 2 and r.num_warmup == 1 and r.ep_size == ep and r.world_size == ep
        assert 0 < r.setup_s < 600  # construction + the checked first call, in seconds
        assert r.tflops_per_gpu == pytest.approx(r.flops_per_gpu / (r.latency_ms / 1e3) / 1e12)
        assert r.dispatch_bytes > 0 and r.combine_bytes > 0 and r.dispatch_local_bytes > 0
        assert r.dispatch_gb_s > 0 and r.raw_a2a_gb_s > 0
        assert r.gpu_name == "cpu" and r.torch_version and r.git_sha
        ref = by(df, "reference", d)
        assert ref.status == "ok" and ref.max_abs_err == 0 and pd_isna(ref.latency_ms)
    assert by(df, "nccl", "bwd").flops_per_gpu == 2 * by(df, "nccl", "fwd").flops_per_gpu
    # the file on disk holds the same rows
    assert len(results.load(results_dir)) == 6


def pd_isna(v) -> bool:
    import pandas as pd

    return bool(pd.isna(v))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_compiled_nccl_matches_reference(results_dir, precision):
    """``compile_mode=published`` through the harness on gloo ranks: nccl's expert math under
    torch.compile(max-autotune) is checked like the eager path, and the row says how it ran and what compiling cost.
    fp8: the prequantized weights enter the compiled function as inputs (straight-through gradient)."""
    df = run_benchmark(cpu_cfg(results_dir, "ep_size=2", "backends=[nccl]", "directions=[fwd,bwd]", "compile=true",
                               "compile_mode=published", f"precision={precision}"))
    for d in ("fwd", "bwd"):
        r = by(df, "nccl", d)
        assert r.status == "ok", r.error
        assert r.compiled and r.compile_mode == "max-autotune"
        assert r.max_abs_err < 0.5 and r.rel_err < (0.01 if precision == "bf16" else 0.1) and r.latency_ms > 0
    assert by(df, "nccl", "fwd").setup_s > 0


def test_a_finished_backend_leaves_no_compiled_state():
    """Between backends the runner drops torch.compile's caches (and on CUDA the CUDA graph trees' memory pool):
    a function compiled by one backend is compiled again by the next."""
    import torch

    from harness.measure.runner import _release_memory

    compiles = []

    def count(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    f = torch.compile(lambda x: x * 2 + 1, backend=count)
    f(torch.ones(3))
    f(torch.ones(3))
    assert len(compiles) == 1
    _release_memory()
    f(torch.ones(3))
    assert len(compiles) == 2


def test_the_allocator_default_is_set_unless_the_user_set_one(monkeypatch):
    """CUDA workers run with expandable segments (kimi_k2_7's mok_hopper backward ran out of memory with 10.8 GiB
    reserved but unallocated without them) unless PYTORCH_CUDA_ALLOC_CONF is set, and rows record the setting."""
    from harness.measure import env

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert env.cuda_alloc_conf() == env.DEFAULT_ALLOC_CONF == "expandable_segments:True"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == env.DEFAULT_ALLOC_CONF
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert env.cuda_alloc_conf() == "max_split_size_mb:512"
    env.collect.cache_clear()
    try:
        assert env.collect("cpu")["cuda_alloc_conf"] is None  # a CPU row has no CUDA allocator (CUDA: the setting)
    finally:
        env.collect.cache_clear()
    assert "cuda_alloc_conf" in results.COLUMNS


@pytest.mark.slow
def test_backends_run_in_the_order_asked_and_rows_say_where(results_dir):
    df = run_benchmark(cpu_cfg(results_dir, "ep_size=2", "backends=[nccl,fwd_only]", "directions=[fwd]",
                               "backend_order=reverse"))
    assert dict(zip(df.backend, df.backend_position)) == {"fwd_only": 0, "nccl": 1}
    assert list(df.backend) == ["fwd_only", "nccl"] and (df.status == "ok").all()


@pytest.mark.slow
def test_bytes_follow_the_routing(nccl_run):
    """nccl sends one row per (token, k) routed to another rank: remote + local rows = T * topk."""
    df, _ = nccl_run(2)
    r = by(df, "nccl", "fwd")
    assert (r.dispatch_bytes + r.dispatch_local_bytes) == 64 * 2 * 256 * 2  # T * topk * H * bf16
    assert r.combine_bytes + r.combine_local_bytes == r.dispatch_bytes + r.dispatch_local_bytes


@pytest.mark.slow
def test_a_setup_past_its_limit_is_a_timeout_row_and_the_point_goes_on(results_dir, capfd):
    """setup_timeout_s: the slow backend's rows say timeout (and why), the backend after it runs as usual, and the
    limit is gone once the setup is over (nccl's setup and timing outlast nothing)."""
    df = run_benchmark(cpu_cfg(results_dir, "ep_size=1", "backends=[slow_setup,nccl]", "directions=[fwd]",
                               "setup_timeout_s=2"))
    # the rank's own progress line times the setup step alone (no process start or import in it): the 60 s sleep
    # was cut, however slowly the machine started the rank
    took = re.findall(r"slow_setup \(1/2\) \| setup \(construct, buffers, JIT builds\): timeout in ([\d.]+) s",
                      capfd.readouterr().err)
    assert len(took) == 1 and float(took[0]) < 55, took
    slow = by(df, "slow_setup", "fwd")
    assert slow.status == "timeout" and "slow_setup's setup ran past setup_timeout_s=2 s" in slow.error
    assert by(df, "nccl", "fwd").status == "ok"


@pytest.mark.slow
def test_setup_profiles_say_where_each_backends_setup_went(results_dir, tmp_path):
    """profile_setup_dir: one profile a backend a rank, of the steps setup_s holds (construction, setup, the checked
    first call), written for a setup that failed too; the rows are what they would be without it."""
    import pstats

    prof_dir = tmp_path / "profiles"
    df = run_benchmark(cpu_cfg(results_dir, "ep_size=2", "backends=[nccl,fails_setup]", "directions=[fwd]",
                               f"profile_setup_dir={prof_dir}"))
    assert by(df, "nccl", "fwd").status == "ok" and by(df, "fails_setup", "fwd").status == "error"
    assert "setup under cProfile" in by(df, "nccl", "fwd").notes  # its setup_s holds the profiler's overhead
    for name in ("nccl", "fails_setup"):
        for rank in (0, 1):
            stem = [p for p in prof_dir.glob(f"*-{name}-rank{rank}.prof")]
            assert len(stem) == 1, sorted(p.name for p in prof_dir.iterdir())
            funcs = {f"{os.path.basename(f)}:{fn}" for f, _, fn in pstats.Stats(str(stem[0])).stats}
            assert ("nccl.py:setup" if name == "nccl" else "fake_backends.py:setup") in funcs  # the backend's own
            # the first call only after a setup that ran
            assert ("correctness.py:run_once" in funcs) == (name == "nccl")
            text = stem[0].with_suffix(".txt").read_text()
            assert "setup steps under cProfile" in text and "most own time" in text
    from harness.measure.runner import prepare

    point = prepare(cpu_cfg(results_dir, "ep_size=2", "backends=[nccl]", "directions=[fwd]"))[0]
    assert set(df.config_hash) == {point.config_hash}  # the hash a run without profiles writes


def test_time_limit_interrupts_and_restores():
    import signal
    import time

    from harness.measure.limits import StepTimeout, time_limit

    before = signal.getsignal(signal.SIGALRM)
    finished = []
    with pytest.raises(StepTimeout, match="the step ran past setup_timeout_s=0.2 s"):
        with time_limit(0.2, "the step"):
            time.sleep(5)
            finished.append(True)
    assert not finished  # the sleep was cut, not waited out (however late the process ran)
    assert signal.getsignal(signal.SIGALRM) is before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    with time_limit(None, "no limit"):
        time.sleep(0.3)
    with time_limit(600, "fast"):  # done in time (the limit far beyond any stall): nothing raised, the timer off
        pass
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


@pytest.mark.slow
def test_failures_become_rows_and_the_sweep_goes_on(results_dir):
    cfg = cpu_cfg(results_dir, "ep_size=2",
                  "backends=[fails_setup,not_installed,wrong,fwd_only,nan_grad,nccl]", "directions=[fwd,bwd]")
    df = run_benchmark(cfg)
    assert len(df) == 12
    assert by(df, "fails_setup", "fwd").status == "error" and "boom in setup" in by(df, "fails_setup", "bwd").error
    nu = by(df, "not_installed", "fwd")
    assert nu.status == "unsupported" and "pip install frobnicate" in nu.error
    w = by(df, "wrong", "fwd")
    assert w.status == "mismatch" and w.rel_err > 0.05 and pd_isna(w.latency_ms)  # mismatches are not timed
    # a forward-only backend is checked on its output and timed forward; its backward is unsupported
    assert by(df, "fwd_only", "fwd").status == "ok" and by(df, "fwd_only", "bwd").status == "unsupported"
    # the gate is per direction: NaN weight gradients fail the backward row; the forward output is fine and timed
    ng = by(df, "nan_grad", "bwd")
    assert ng.status == "mismatch" and ng.worst_tensor.startswith("d_w") and pd_isna(ng.latency_ms)
    # the message names the tensor of each worst error (abs-max and rel-L1 can come from different tensors)
    assert "abs-max inf (tol 0.5) on d_w_down" in ng.error and "rel-L1 inf (tol 0.01) on d_w_down" in ng.error, ng.error
    assert "(tol 0.5) on out," in w.error or "(tol 0.5) on d_" in w.error, w.error
    ngf = by(df, "nan_grad", "fwd")
    assert ngf.status == "ok" and ngf.worst_tensor == "out" and ngf.rel_err < 0.01 and ngf.latency_ms > 0
    for d in ("fwd", "bwd"):
        assert by(df, "nccl", d).status == "ok"


@pytest.mark.slow
def test_forward_only_backend_gets_unsupported_backward(results_dir):
    df = run_benchmark(cpu_cfg(results_dir, "ep_size=2", "backends=[fwd_only]", "directions=[fwd]"))
    assert by(df, "fwd_only", "fwd").status == "ok"
    df = run_benchmark(cpu_cfg(results_dir, "ep_size=2", "backends=[fwd_only]", "directions=[bwd]", "check=false"))
    r = by(df, "fwd_only", "bwd")
    assert r.status == "unsupported" and "implements fwd only" in r.error


@pytest.mark.slow
def test_a_rank_that_dies_leaves_rows_from_the_launcher(results_dir):
    cfg = cpu_cfg(results_dir, "ep_size=2", "backends=[nccl,dies]", "directions=[fwd]", "dist_timeout_s=60")
    df = run_benchmark(cfg)
    assert by(df, "nccl", "fwd").status == "ok"
    r = by(df, "dies", "fwd")
    assert r.status in ("error", "timeout") and "no row reported" in r.error
    assert len(results.load(results_dir)) == 2


@pytest.mark.slow
def test_fp8_is_checked_with_fp8_tolerances_and_mxfp8_is_unsupported_on_cpu(results_dir):
    # one run for both directions: the forward row is gated on the output alone, as in a forward-only run
    df = run_benchmark(cpu_cfg(results_dir, "ep_size=2", "precision=fp8", "directions=[fwd,bwd]"))
    r = by(df, "nccl", "fwd")
    assert r.status == "ok" and r.atol == 1.0 and r.rtol == 0.1 and r.worst_tensor == "out"
    assert 0.005 < r.rel_err < 0.1 and "1x128/128x128" in r.scaling  # e4m3 rounding is visible, and small
    # With backward, all 8 gradients are gated too. The weight gradients here reach |35|, so e4m3's ~4% element
    # error can exceed the published abs-max 1.0 while the relative L1 error stays within 0.1.
    r = by(df, "nccl", "bwd")
    assert r.rel_err < 0.1 and r.worst_tensor.startswith("d_")
    assert r.status == "ok" or (r.status == "mismatch" and "(tol 1.0)" in r.error)
    df = run_benchmark(cpu_cfg(results_dir, "ep_size=2", "precision=mxfp8", "directions=[fwd]"))
    r = by(df, "nccl", "fwd")
    assert r.status == "unsupported" and "Blackwell" in r.error and "precision=fp8" in r.error


@pytest.mark.slow
def test_clamped_swiglu_single_rank_and_imbalanced_routing(results_dir):
    df = run_benchmark(cpu_cfg(results_dir, "ep_size=1", "shape.swiglu_limit=0.05", "directions=[fwd,bwd]"))
    assert (df.status == "ok").all() and df.swiglu_limit.iloc[0] == 0.05
    df = run_benchmark(cpu_cfg(results_dir, "ep_size=2", "workload=zipf", "workload.zipf_exponent=1.5",
                               "directions=[bwd]"))
    r = by(df, "nccl", "bwd")
    assert r.status == "ok" and r.routing == "zipf(s=1.5)" and r.expert_load_max_over_mean > 1.5


# A rank whose experts get no token at all: every rank must still run the same collectives (the reference's
# backward once skipped its all-gather and all-reduce there, and gloo aborted with a collective mismatch).
TINY_CUSTOM = ("shape=custom", "shape.num_experts=8", "shape.hidden=32", "shape.ffn=16", "shape.topk=2")
IDLE_RANK_CASES = {  # name: (EP, routing, other options)
    "issue20_ep2": (2, ("workload.tokens_per_gpu=1", "workload.seed=16"), ()),
    "ep4": (4, ("workload.tokens_per_gpu=1", "workload.seed=4"), ()),
    "hot_rank": (2, ("workload=hot_rank", "workload.tokens_per_gpu=4", "workload.seed=10"), ()),
    "hot_experts": (2, ("workload=hot_experts", "workload.tokens_per_gpu=1", "workload.seed=0"), ()),
    "compiled": (2, ("workload.tokens_per_gpu=1", "workload.seed=16"), ("compile=true", "compile_mode=default")),
    "fp8": (2, ("workload.tokens_per_gpu=1", "workload.seed=16"),
            ("precision=fp8", "shape.hidden=128", "shape.ffn=128")),
}


def rows_per_rank(ep: int, *overrides: str) -> list[int]:
    """Routed (token, k) rows each rank's experts receive, from the harness's own routing."""
    import torch
    from conftest import compose_cfg

    from harness.config.point import make_case
    from harness.measure.inputs import make_routing

    case = make_case(compose_cfg("device=cpu", *overrides), ep_size=ep, device="cpu")
    idx = torch.cat([make_routing(case, r)[0] for r in range(ep)])
    return torch.bincount(idx.flatten(), minlength=case.num_experts).view(ep, -1).sum(1).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(IDLE_RANK_CASES))
def test_a_rank_whose_experts_get_no_token(results_dir, case):
    ep, workload, other = IDLE_RANK_CASES[case]
    loads = rows_per_rank(ep, *TINY_CUSTOM, *workload)
    assert 0 in loads and sum(loads) > 0, f"the case must leave a rank idle: rows per rank {loads}"
    df = run_benchmark(cpu_cfg(results_dir, f"ep_size={ep}", *TINY_CUSTOM, *workload, *other,
                               "backends=[nccl,mok_hopper,reference]", "directions=[fwd,bwd]"))
    atol, rtol = (1.0, 0.1) if case == "fp8" else (0.5, 0.01)
    for d in ("fwd", "bwd"):
        r = by(df, "nccl", d)
        assert r.status == "ok", r.error
        assert r.max_abs_err < atol and r.rel_err < rtol and r.latency_ms > 0
        # every routed row crosses to the busy ranks: the byte columns count them (idle ranks receive nothing)
        assert (r.dispatch_bytes + r.dispatch_local_bytes) * ep == sum(loads) * r.hidden * 2
        assert by(df, "reference", d).status == "ok"
    assert by(df, "nccl", "bwd").worst_tensor.startswith("d_")
    m = by(df, "mok_hopper", "fwd")  # the CPU twin of the fused kernel
    assert m.status == "ok" and m.rel_err < rtol, m.error
    b = by(df, "mok_hopper", "bwd")  # its backward twin: an idle rank still takes part in every delivery
    if case == "hot_experts":
        # one token per GPU: the router-weight gradient is two numbers a rank. The harness's reference runs its GEMMs
        # in bf16 (outputs rounded), the twin sums in fp32 from the saved bf16 H: they differ by 1.5% rel-L1 here, over
        # the gate's 1%, while the twin is within 0.23% of an fp32 autograd reference on these inputs (3e-7 with an
        # fp32 H; session 13). On the published shapes the kernel's is within 0.3% of the reference.
        assert b.status == "mismatch" and b.worst_tensor == "d_topk_w" and b.rel_err < 0.05, (b.status, b.error)
        assert b.max_abs_err < atol
    elif case == "fp8":
        # the fp8 backward twin: the router-weight gradient is <G, A> with G = dO W2 in e4m3 (SonicMoE's
        # form, which needs no Y), noisier than the emulated nccl's <dO, Y> (Y from the forward): 0.06-0.07 rel-L1
        # on the twin at H = 2048, 0.109 here on the two numbers a rank has at one token per GPU
        assert b.status in ("ok", "mismatch") and b.max_abs_err < atol and b.rel_err < 0.15, b.error
        assert b.status == "ok" or b.worst_tensor == "d_topk_w", b.error
    else:
        assert b.status == "ok" and b.rel_err < rtol, b.error


def test_zero_rows_stay_in_the_autograd_graph():
    """An idle rank's experts get [0, H] rows: their output must still depend on x and the weights, so that backward
    reaches that rank's collectives and the weights get a zero gradient, on either GEMM path (counts=[]: the
    torch._grouped_mm calling convention)."""
    import torch

    from baselines.common import expert_mlp

    L, H, I = 3, 8, 4
    w13 = torch.randn(L, 2 * I, H, dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.randn(L, H, I, dtype=torch.bfloat16, requires_grad=True)
    for counts in ([0] * L, []):
        x = torch.zeros(0, H, dtype=torch.bfloat16, requires_grad=True)
        y = expert_mlp(x, w13, w2, torch.zeros(L, dtype=torch.int32), counts, None)
        assert y.shape == (0, H) and y.requires_grad
        y.float().sum().backward()
        assert x.grad.shape == (0, H)
        assert w13.grad is not None and not w13.grad.any() and w2.grad is not None and not w2.grad.any()
        w13.grad = w2.grad = None


def _cli(*args, tmp):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HYDRA_FULL_ERROR="0")
    return subprocess.run([sys.executable, "-m", "harness.run", *args, f"results_dir={tmp}",
                           f"hydra.run.dir={tmp}/hydra"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_cli_default_runs_and_prints_a_table(results_dir):
    p = _cli("device=cpu", "workload.tokens_per_gpu=64", tmp=results_dir)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "nccl" in p.stdout and "ok" in p.stdout and "rel_err" in p.stdout and "routing" in p.stdout
    df = results.load(results_dir)
    assert set(df.status) == {"ok"} and set(df.direction) == {"fwd", "bwd"}
    # progress on stderr: which point, backend and phase, with seconds (rank 0 only: each line once)
    point = re.escape("tiny bf16 uniform EP2 T64")
    lines = p.stderr.splitlines()
    for phase in (r"inputs: ok", r"reference: ok",
                  r"nccl \(1/1\) \| setup \(construct, buffers, JIT builds\): ok",
                  r"nccl \(1/1\) \| check: first call against the reference: ok",
                  r"nccl \(1/1\) \| timing fwd \(\d+ warmup \+ \d+ timed\): ok",
                  r"nccl \(1/1\) \| timing bwd \(\d+ warmup \+ \d+ timed\): ok"):
        rx = re.compile(rf"^mokbench \[\s*\d+\.\d s\] {point} \| {phase} in \d+\.\d s")
        assert sum(bool(rx.match(ln)) for ln in lines) == 1, (phase, p.stderr[-3000:])
    assert any(re.match(rf"^mokbench \[\s*\d+\.\d s\] {point} \| nccl \(1/1\) \| timing fwd .* ok in .*, median "
                        rf"\d", ln) for ln in lines)
    # the last line: where the rows went, and the command that reports them
    run_dir = results_dir / df.run_id.iloc[0]
    assert p.stdout.strip().splitlines()[-1] == (
        f"mokbench: 2 rows (2 ok) in {run_dir}; report: python -m harness.report {run_dir} --out "
        f"{results_dir}/reports/{run_dir.name}")  # beside the run, in its results_dir


def test_progress_lines():
    from harness.measure.runner import Progress

    pr = Progress(True, "kimi_k2_7 bf16 uniform EP8 T2048")
    pr.backend = "deepep (2/6)"
    assert re.fullmatch(r"mokbench \[\s*\d+\.\d s\] kimi_k2_7 bf16 uniform EP8 T2048 \| deepep \(2/6\) \| check",
                        pr.line("check"))


@pytest.mark.slow
def test_multirun_table_says_which_point_and_workload(results_dir):
    """A multirun on this machine (hydra/launcher=node): each point's table names its point and workload, and the
    progress lines lead with the point's number."""
    p = _cli("-m", "hydra/launcher=node", f"hydra.sweep.dir={results_dir}/sweep", "device=cpu",
             "workload.tokens_per_gpu=64", "workload=uniform,zipf", "direction=fwd", "timing.num_iters=2",
             tmp=results_dir)
    assert p.returncode == 0, p.stderr[-3000:]
    titles = [ln for ln in p.stdout.splitlines() if ln.startswith("sweep point #")]
    assert len(titles) == 2 and "workload=uniform" in titles[0] and "workload=zipf" in titles[1], p.stdout
    assert "zipf(s=1)" in p.stdout.split("sweep point #1")[1]
    assert re.search(r"^mokbench \[\s*\d+\.\d s\] point #1 tiny bf16 zipf\(s=1\) EP2 T64 \| nccl", p.stderr, re.M)
    rows = results.load(results_dir)
    assert len(rows) == 2
    from harness.core.run_names import sweep_run_id

    assert set(rows.run_id) == {sweep_run_id("cpu", f"{results_dir}/sweep")}  # one run: what the sweep is, where


@pytest.mark.slow
def test_traffic_is_measured_without_the_check(results_dir):
    """check=false: no checked forward has run when the byte counts are taken, so the runner runs one (untimed);
    the columns equal the checked run's for the same seed, and no rank prints a traceback."""
    cols = ["dispatch_bytes", "dispatch_local_bytes", "combine_bytes", "combine_local_bytes"]
    runs = {}
    for check in ("true", "false"):
        p = _cli("device=cpu", "shape=tiny", "timing=quick", "timing.num_warmup=1", "timing.num_iters=2",
                 "timing.phase_iters=2", "workload.tokens_per_gpu=64", "workload.seed=3", f"check={check}",
                 tmp=results_dir / check)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
        runs[check] = df = results.load(results_dir / check)
        assert set(df.status) == {"ok"} and len(df) == 2
    for d in ("fwd", "bwd"):
        on, off = by(runs["true"], "nccl", d), by(runs["false"], "nccl", d)
        assert pd_isna(off.rel_err) and not pd_isna(on.rel_err)  # the second run really skipped the check
        assert [off[c] for c in cols] == [on[c] for c in cols] and off.dispatch_bytes > 0
        assert off.dispatch_gb_s > 0 and off.combine_gb_s > 0 and off.raw_a2a_gb_s > 0
        assert "traffic" not in str(off.get("notes", ""))


@pytest.mark.parametrize("args,message", [
    (["backends=[nope]"], "unknown backend 'nope'"),
    (["shape=tiny", "shape.num_experts=7"], "not divisible by ep_size=2"),
    (["precision.name=int3"], "unknown precision"),
    (["device=cpu", "workload=hot_rank", "workload.hot_rank=5"], "hot_rank=5"),
])
def test_cli_rejects_bad_configs_before_anything_runs(results_dir, args, message):
    p = _cli("device=cpu", *args, tmp=results_dir)
    assert p.returncode == 2
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in p.stderr
    assert not results_dir.exists()  # neither rows nor Hydra's run folder (results_dir/hydra)


def test_cli_unknown_shape_is_rejected_by_hydra_with_the_options(results_dir):
    p = _cli("shape=nope", tmp=results_dir)
    assert p.returncode != 0 and "kimi_k2_7" in p.stderr and "Traceback" not in p.stderr
    assert not results_dir.exists()


@pytest.mark.slow
def test_deepep_backends_are_unsupported_rows_with_the_install_hint_on_cpu(results_dir):
    df = run_benchmark(cpu_cfg(results_dir, "ep_size=2", "backends=[deepep,hybridep,nccl]", "directions=[fwd]"))
    for b in ("deepep", "hybridep"):
        r = by(df, b, "fwd")
        assert r.status == "unsupported" and "GPU" in r.error
    assert by(df, "nccl", "fwd").status == "ok"
