"""Replayed routing traces (harness/config/routing_trace.py, configs/workload/trace.yaml, scripts/capture_routing.py):
the format and its checks, each rank's share of a trace at EP 1, 2 and 4, the point's identity, the refusals, and a
trace captured from a tiny transformers MoE model replayed through ``python -m harness.run``."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TESTS, compose_cfg

from harness.core import results
from harness.config import routing, routing_trace
from harness.config.schema import config_hash, to_container
from harness.core.errors import ConfigError
from harness.measure.inputs import make_inputs
from harness.config.point import make_case
from harness.config.routing import load_stats, make_routing, make_steps

PREFIX = "mokbench: invalid configuration: "


def _synthetic(folder: Path, *, steps: int = 2, layers: int = 3, tokens: int = 128, experts: int = 8, topk: int = 2,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A trace of random distinct top-k ids and normalised gates; returns (ids, gates) [S, Y, N, K]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(steps, layers, tokens, experts, generator=g).topk(topk, dim=-1).indices
    gates = torch.rand(steps, layers, tokens, topk, generator=g) + 0.1
    gates = gates / gates.sum(-1, keepdim=True)
    routing_trace.write_trace(folder, ids, gates, model={"name": "synthetic", "num_experts": experts, "topk": topk,
                                                         "hidden_size": 64}, capture={"tool": "tests"})
    return ids, gates


def _case(trace: Path, *overrides: str, ep_size: int = 2):
    cfg = compose_cfg("device=cpu", "shape=tiny", "workload=trace", f"workload.trace_path={trace}",
                      "workload.tokens_per_gpu=32", *overrides)
    c = to_container(cfg)
    return c, make_case(c, ep_size=ep_size, device="cpu")


def test_a_written_trace_verifies_and_its_digest_is_its_tensors(tmp_path):
    _synthetic(tmp_path / "t")
    m, digest = routing_trace.verify(tmp_path / "t")
    assert m["format"] == routing_trace.FORMAT and m["num_experts"] == 8 and m["topk"] == 2
    assert m["model"]["name"] == "synthetic" and m["capture"] == {"tool": "tests"}
    assert {n: e["shape"] for n, e in m["tensors"].items()} == {"expert_ids": [2, 3, 128, 2], "gates": [2, 3, 128, 2],
                                                               "source_rank": [128]}
    shutil.copytree(tmp_path / "t", tmp_path / "copy")  # the same tensors elsewhere: the same identity
    assert routing_trace.verify(tmp_path / "copy")[1] == digest
    _synthetic(tmp_path / "other", seed=1)
    assert routing_trace.verify(tmp_path / "other")[1] != digest
    with pytest.raises(FileExistsError):
        _synthetic(tmp_path / "t")


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_each_rank_replays_its_share_of_the_global_batch(tmp_path, ep):
    """Rank r replays the trace's tokens [r*T, (r+1)*T) of the chosen step and layer, as global expert ids: the
    ranks' routing together is the trace's, so each destination rank receives from every source rank exactly the
    rows the trace sends to its local experts, at any EP size."""
    ids, gates = _synthetic(tmp_path / "t")
    _, case = _case(tmp_path / "t", "workload.trace_layer=2", ep_size=ep)
    assert case.local_experts == 8 // ep
    got = [make_routing(case, r) for r in range(ep)]
    for idx, w in got:
        assert idx.dtype == torch.int64 and w.dtype == torch.float32 and idx.shape == (32, 2)
    t = 32 * ep
    assert torch.equal(torch.cat([i for i, _ in got]), ids[0, 2, :t])
    assert torch.equal(torch.cat([w for _, w in got]), gates[0, 2, :t])
    for src, (idx, _) in enumerate(got):  # what source rank src sends to each destination's local experts
        dest = idx // case.local_experts
        want = ids[0, 2, src * 32:(src + 1) * 32] // case.local_experts
        assert torch.equal(torch.bincount(dest.flatten(), minlength=ep), torch.bincount(want.flatten(), minlength=ep))
    stats = load_stats(torch.cat([i for i, _ in got]), case)
    counts = torch.bincount(ids[0, 2, :t].flatten(), minlength=8).double()
    assert stats["expert_load_max_over_mean"] == pytest.approx(float(counts.max() / counts.mean()))
    assert torch.equal(routing_trace.trace_routing(case, 0, step=3)[0], ids[1, 2, :32])  # step 3 of 2: step 1


def test_a_megatron_shaped_trace_is_one_step_of_one_layer(tmp_path):
    """A trace with 2-D [N, K] expert_ids / gates and Megatron's manifest fields (PR #7488's trace v1) replays as
    step 0, layer 0."""
    folder = tmp_path / "mt"
    (folder / "tensors").mkdir(parents=True)
    g = torch.Generator().manual_seed(3)
    ids = torch.rand(64, 8, generator=g).topk(2, dim=-1).indices
    gates = torch.full((64, 2), 0.5)
    src = torch.arange(64, dtype=torch.int32) // 32
    entries = {}
    for name, t in {"token_ids": ids, "expert_ids": ids, "gates": gates, "source_rank": src}.items():
        torch.save(t, folder / "tensors" / f"{name}.pt")
        entries[name] = {"file": f"tensors/{name}.pt", "sha256": routing_trace._sha256(folder / "tensors" /
                                                                                      f"{name}.pt"),
                         "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    (folder / "manifest.json").write_text(json.dumps({
        "schema_version": 1, "producer_commit": "x", "seed": 0, "logical_layer_id": 0, "step_id": 0,
        "microbatch_id": 0, "logical_num_tokens": 64, "num_experts": 8, "topk": 2, "hidden_size": 64,
        "world_size": 2, "original_partition": "rank-major, contiguous per source rank", "workload_id": "W0",
        "workload_checksum": "x", "tensors": entries}))
    _, case = _case(folder)
    assert torch.equal(torch.cat([make_routing(case, r)[0] for r in range(2)]), ids)


def test_a_trace_point_is_identified_by_its_tensors_and_layer_not_its_path(tmp_path):
    _synthetic(tmp_path / "t")
    shutil.copytree(tmp_path / "t", tmp_path / "elsewhere")
    hashes = {}
    for name, folder, layer in [("a", "t", 0), ("moved", "elsewhere", 0), ("layer1", "t", 1)]:
        c, case = _case(tmp_path / folder, f"workload.trace_layer={layer}")
        hashes[name] = config_hash(c, case)
        digest = dict(case.routing_params)["trace_sha256"]
        assert routing.label(case) == f"trace({digest[:12]},layer={layer})"
    assert hashes["a"] == hashes["moved"] != hashes["layer1"]
    c = to_container(compose_cfg("device=cpu", "shape=tiny", "workload=zipf"))  # the new fields at their defaults
    case = make_case(c, ep_size=2, device="cpu")
    old = {k: v for k, v in c["workload"].items() if k not in ("trace_path", "trace_layer")}
    assert config_hash(c, case) == config_hash(dict(c, workload=old), case)


def test_the_trace_is_a_routing_model_whose_steps_replay_the_traces_steps(tmp_path):
    """``trace`` is a model of the table: its Case holds the folder (absolute), layer and digest; the inputs hold
    step 0; with ``workload.steps=N`` step s replays the trace's step s mod S (here S = 2, N = 3)."""
    ids, gates = _synthetic(tmp_path / "t")
    assert routing.MODELS["trace"] is routing.rm.Trace
    c, case = _case(tmp_path / "t", "workload.trace_layer=1", "workload.steps=3")
    params = dict(case.routing_params)
    assert params == {"trace_path": str((tmp_path / "t").resolve()), "trace_layer": 1,
                      "trace_sha256": routing_trace.verify(tmp_path / "t")[1]}
    assert routing.label(case) == f"trace({params['trace_sha256'][:12]},layer=1)+3steps"
    inp = make_inputs(case, 1, torch.device("cpu"))
    assert torch.equal(inp.topk_idx_TK, ids[0, 1, 32:64]) and torch.equal(inp.topk_w_TK, gates[0, 1, 32:64])
    for rank in range(2):
        got_ids, got_w = make_steps(case, rank)
        want = [s % 2 for s in range(3)]
        assert torch.equal(got_ids, ids[want, 1, rank * 32:(rank + 1) * 32])
        assert torch.equal(got_w, gates[want, 1, rank * 32:(rank + 1) * 32])
    one = config_hash(*_case(tmp_path / "t", "workload.trace_layer=1"))
    assert config_hash(c, case) != one  # three routing steps are another point


def _damage(folder: Path, how: str) -> None:
    t = folder / "tensors"
    if how == "checksum":
        (t / "gates.pt").write_bytes((t / "gates.pt").read_bytes()[:-8] + b"\0" * 8)
    elif how == "missing tensor":
        (t / "expert_ids.pt").unlink()
    elif how == "unlisted tensor":
        m = json.loads((folder / "manifest.json").read_text())
        del m["tensors"]["gates"]
        (folder / "manifest.json").write_text(json.dumps(m))
    elif how in ("wrong shape", "unnormalised gates", "repeated expert"):
        name = "gates" if how != "repeated expert" else "expert_ids"
        x = torch.load(t / f"{name}.pt")
        x = {"wrong shape": lambda: x[:, :, :, :1].contiguous(), "unnormalised gates": lambda: x * 2,
             "repeated expert": lambda: x[..., :1].expand(x.shape).contiguous()}[how]()
        torch.save(x, t / f"{name}.pt")
        m = json.loads((folder / "manifest.json").read_text())
        m["tensors"][name].update(sha256=routing_trace._sha256(t / f"{name}.pt"))
        (folder / "manifest.json").write_text(json.dumps(m))
    elif how == "not json":
        (folder / "manifest.json").write_text("{")
    elif how == "no manifest":
        (folder / "manifest.json").unlink()


DAMAGE = {"checksum": "tensors/gates.pt does not match its sha256 in manifest.json",
          "missing tensor": "tensor file tensors/expert_ids.pt is missing",
          "unlisted tensor": "manifest.json lists no tensor 'gates'",
          "wrong shape": "tensors/gates.pt is float32 [2, 3, 128, 1], the manifest says float32 [2, 3, 128, 2]",
          "unnormalised gates": "a token's gates sum to 1 +- 1, not within 0.001",
          "repeated expert": "a token chooses one expert twice",
          "not json": "manifest.json is not JSON",
          "no manifest": "no manifest.json"}


@pytest.mark.parametrize("how", list(DAMAGE))
def test_a_damaged_trace_is_refused(tmp_path, how):
    _synthetic(tmp_path / "t")
    _damage(tmp_path / "t", how)
    with pytest.raises(ConfigError, match=f"routing trace {tmp_path / 't'}: ") as e:
        _case(tmp_path / "t")
    assert DAMAGE[how] in str(e.value)


MISMATCH = {"num_experts": (["shape=custom", "shape.num_experts=16", "shape.topk=2", "shape.hidden=256",
                             "shape.ffn=128"], "it was captured with num_experts=8, topk=2 and the point has "
                            "num_experts=16, topk=2: run it on a shape with both (shape=custom "
                            "shape.num_experts=8 shape.topk=2 ...)"),
            "topk": (["shape.topk=4"], "and the point has num_experts=8, topk=4"),
            "tokens": (["workload.tokens_per_gpu=100"], "it holds 128 tokens a step and EP 2 x 100 tokens per rank "
                       "need 200: give workload.tokens_per_gpu<=64 or capture more tokens"),
            "layer": (["workload.trace_layer=3"], "it holds 3 layer(s), no layer 3: give workload.trace_layer=0..2"),
            "no path": (["workload.trace_path=null"], "workload=trace needs workload.trace_path=<a trace folder>")}


@pytest.mark.parametrize("what", list(MISMATCH))
def test_a_point_the_trace_cannot_serve_is_refused(tmp_path, what):
    _synthetic(tmp_path / "t")
    args, line = MISMATCH[what]
    with pytest.raises(ConfigError) as e:
        _case(tmp_path / "t", *args)
    assert line in str(e.value)


def test_a_trace_changed_after_its_check_is_not_replayed(tmp_path):
    _synthetic(tmp_path / "t")
    _, case = _case(tmp_path / "t")
    with pytest.raises(ConfigError, match="it changed since the point was checked"):
        params = dict(case.routing_params, trace_sha256="0" * 64)
        make_routing(dataclasses.replace(case, routing_params=tuple(sorted(params.items()))), 0)


# --- capture from a tiny transformers model, and the replay through harness.run ---

def _capture_module():
    spec = importlib.util.spec_from_file_location("capture_routing", ROOT / "scripts" / "capture_routing.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "olmoe"])
def test_the_capture_records_each_layers_router_choice(kind):
    """The hook's ids are the router's own top-k, its weights the router's scores renormalised (checked against a
    direct call of each router on the hidden states it saw), for every MoE layer of the tiny model."""
    cap = _capture_module()
    model = cap.tiny_model(kind, num_experts=8, topk=2, layers=2)
    routers = cap.routers(model)
    assert len(routers) == 2
    seen = []
    hooks = [m.register_forward_hook(lambda mod, i, o: seen.append((mod, i[0].detach()))) for _, m in routers]
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    ids, gates, how = cap.capture(model, [batch])
    for h in hooks:
        h.remove()
    assert ids.shape == gates.shape == (1, 2, 32, 2) and "router's top-k" in how
    for layer, (mod, x) in enumerate(seen):
        _, scores, idx = mod(x)
        assert torch.equal(ids[0, layer], idx)
        assert torch.allclose(gates[0, layer], scores.float() / scores.float().sum(-1, keepdim=True))
    assert torch.allclose(gates.sum(-1), torch.ones(1, 2, 32))
    assert len(set(ids.flatten().tolist())) > 2  # random weights spread the tokens (not one tie broken alike)
    logits = torch.randn(32, 8)  # a router that returns logits alone: softmax, top-k, renormalised
    i, w, _ = cap._topk(logits, 2)
    p = torch.softmax(logits, -1).topk(2, -1)
    assert torch.equal(i, p.indices) and torch.allclose(w, p.values / p.values.sum(-1, keepdim=True))


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MOKBENCH_RUN_ID"}
    return dict(env, PYTHONPATH=f"{TESTS}{os.pathsep}{ROOT}", HYDRA_FULL_ERROR="0")


def _harness(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.run", "device=cpu", "shape=tiny", "timing=quick",
                           "timing.num_warmup=1", "timing.num_iters=2", "print_table=false",
                           f"hydra.run.dir={tmp_path}/hydra", *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_a_captured_trace_replays_identically_and_a_bad_one_is_refused(tmp_path):
    """scripts/capture_routing.py on a tiny Qwen3-MoE (random weights, 8 experts, top-2) writes a trace; two runs of
    it through harness.run give the same routing and the same errors against the reference; a damaged or
    mismatched trace is one line, exit 2 and no result file."""
    trace = tmp_path / "trace"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "capture_routing.py"), "--tiny", "qwen3_moe",
                        "--out", str(trace), "--tokens", "256", "--seq-len", "64", "--steps", "2"],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    manifest, digest = routing_trace.verify(trace)
    assert (manifest["model"]["model_type"] == "qwen3_moe"
            and manifest["capture"]["tool"] == "scripts/capture_routing.py")
    cols = ["backend", "direction", "routing", "status", "expert_load_max_over_mean", "rank_load_max_over_mean",
            "empty_experts", "max_abs_err", "rel_err", "config_hash"]
    rows = []
    for run in ("a", "b"):
        p = _harness(tmp_path, "workload=trace", f"workload.trace_path={trace}", "workload.trace_layer=1",
                     "workload.tokens_per_gpu=64", f"results_dir={tmp_path}/{run}")
        assert p.returncode == 0, p.stderr[-3000:]
        df = results.load(tmp_path / run).sort_values(["backend", "direction"]).reset_index(drop=True)
        assert (df.status == "ok").all() and (df.routing == f"trace({digest[:12]},layer=1)").all()
        rows.append(df[cols])
    assert rows[0].equals(rows[1])
    stats = load_stats(torch.load(trace / "tensors" / "expert_ids.pt")[0, 1, :128], _case(trace)[1])
    assert rows[0].expert_load_max_over_mean.iloc[0] == pytest.approx(stats["expert_load_max_over_mean"])

    bad = tmp_path / "bad"
    shutil.copytree(trace, bad)
    _damage(bad, "checksum")
    for args, line in [([f"workload.trace_path={bad}"], "tensors/gates.pt does not match its sha256"),
                       ([f"workload.trace_path={trace}", "shape.topk=3"], "captured with num_experts=8, topk=2")]:
        p = _harness(tmp_path, "workload=trace", "workload.tokens_per_gpu=64", f"results_dir={tmp_path}/refused",
                     *args)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith(PREFIX) and line in lines[0], p.stderr
        assert not (tmp_path / "refused").exists()


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 4])
def test_a_trace_runs_through_dispatch_at_any_ep_size(tmp_path, ep):
    """The same trace through harness.run at EP 1 and 4 (EP 2: the test above): the backend's output and gradients
    match the reference's on the replayed routing, and the rows' load columns are the trace's at that EP size."""
    ids, _ = _synthetic(tmp_path / "t", tokens=128)
    p = _harness(tmp_path, "workload=trace", f"workload.trace_path={tmp_path / 't'}", "workload.tokens_per_gpu=32",
                 f"ep_size={ep}", f"results_dir={tmp_path}/res")
    assert p.returncode == 0, p.stderr[-3000:]
    df = results.load(tmp_path / "res")
    assert len(df) == 2 and (df.status == "ok").all(), df[["status", "error"]]
    counts = torch.bincount(ids[0, 0, :32 * ep].flatten(), minlength=8).double()
    per_rank = counts.view(ep, -1).sum(1)
    assert df.expert_load_max_over_mean.iloc[0] == pytest.approx(float(counts.max() / counts.mean()))
    assert df.rank_load_max_over_mean.iloc[0] == pytest.approx(float(per_rank.max() / per_rank.mean()))
