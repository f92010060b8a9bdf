"""A point keeps its config_hash: recomputing each committed row's hash from its stored configuration gives the stored
hash, and so does every row the harness writes now (its ``point_config``).

The rows in results/runs were written before rows stored their configuration: their point comes back from their
columns plus the launch settings the columns do not hold (tests/data/committed_hash_knobs.json, found by search over
those settings with the hash function of the commit before the backends' options moved out of ``Case``:
tests/data/find_hash_knobs.py). The settings are given as the command line gave them then (``fp8_gemm=``,
``te_fp8_recipe=``, ``mok_hopper_forward=``), so these points also go through today's aliases."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from committed_points import row_config
from conftest import cpu_cfg

from harness.core import results
from harness.config.backend_options import apply_aliases
from harness.config.schema import config_hash
from harness.config.point import make_case

ROOT = Path(__file__).resolve().parent.parent
KNOBS = json.loads((ROOT / "tests" / "data" / "committed_hash_knobs.json").read_text())


def point_of_row(r: pd.Series, knobs: dict) -> dict:
    """A committed row's resolved configuration (tests/committed_points.py), its aliases in the backends' options."""
    c = row_config(r, knobs)
    apply_aliases(c)
    return c


@pytest.fixture(scope="module")
def committed() -> pd.DataFrame:
    return results.load(ROOT / "results" / "runs")


def _hash_of_row(r: pd.Series, knobs: dict) -> str:
    c = point_of_row(r, knobs)
    return config_hash(c, make_case(c, ep_size=int(r["ep_size"]), device=r["device"]))


def test_every_committed_point_keeps_its_hash(committed):
    assert len(committed) > 800  # the committed rows are there
    stored = committed[committed.point_config.notna()]
    for _, r in stored.iterrows():  # rows that store their configuration
        c = json.loads(r.point_config)
        assert config_hash(c, make_case(c, ep_size=int(r.ep_size), device=r.device)) == r.config_hash, r.run_id
    reproduced, older = [], []
    for h, g in committed[committed.point_config.isna()].groupby("config_hash"):
        knobs = KNOBS.get(h)
        assert knobs is not None, (f"{h} (run {g.run_id.iloc[0]}) has no launch settings in "
                                   f"tests/data/committed_hash_knobs.json; rows written now carry point_config")
        r = g.iloc[0]
        got = _hash_of_row(r, knobs)
        if knobs.get("older_hash_function"):
            older.append((h, r, knobs))
            assert got != h  # (checked below against the function that made it)
            continue
        assert got == h, f"{h} (run {r.run_id}, {r.shape} {r.precision}) now hashes to {got}"
        reproduced.append(h)
    assert len(reproduced) == 46 and len(older) == 8


def test_points_hashed_before_fp8_gemm_entered_the_hash_are_that_function_s(committed, monkeypatch):
    """Eight fp8 points of 2026-11-30 were hashed before ``fp8_gemm`` entered fp8 points' hashes (that option's
    ``hash_default``): today's function without that entry gives their stored hashes, so nothing else moved them."""
    import harness.config.backend_options as bo

    hash_entries = bo.hash_entries

    def without_fp8_gemm(c, precision):
        by_alias, scoped = hash_entries(c, precision)
        by_alias.pop("fp8_gemm", None)
        return by_alias, scoped

    monkeypatch.setattr(bo, "hash_entries", without_fp8_gemm)
    older = {h: k for h, k in KNOBS.items() if k and k.get("older_hash_function")}
    assert len(older) == 8
    for h, knobs in older.items():
        r = committed[committed.config_hash == h].iloc[0]
        assert r.precision == "fp8" and str(r.timestamp) < "2026-12-01"
        assert _hash_of_row(r, knobs) == h


def test_old_rows_load_without_the_new_columns(committed):
    old = committed[committed.timestamp.astype(str) < "2026-12-06"]  # written before the two columns
    assert len(old) > 800 and old["backend_options"].isna().all() and old["point_config"].isna().all()
    assert committed["config_hash"].notna().all()


def test_a_row_written_now_gives_back_its_hash_from_its_stored_config(results_dir):
    from harness.measure.runner import run_benchmark

    df = run_benchmark(cpu_cfg(results_dir, "ep_size=2", "backends=[nccl,mok_hopper]", "directions=[fwd]",
                               "precision=fp8", "fp8_gemm=rowwise", "mok_hopper.forward=recompute"))
    assert len(df) == 2
    for _, r in df.iterrows():
        c = json.loads(r.point_config)
        case = make_case(c, ep_size=int(r.ep_size), device=r.device)
        assert config_hash(c, case) == r.config_hash
    by = df.set_index("backend").backend_options
    assert by["nccl"] == "fp8_gemm=rowwise" and by["mok_hopper"] == "forward=recompute,weights=plain,rows=packed"


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_mok_hopper_weights_enter_bf16_hashes_only_away_from_the_old_default(precision):
    """``mok_hopper.weights`` came after points were measured at ``tiled``, then its default moved to ``plain``: a
    bf16 point at tiled keeps the hash it had without the option, and the default (plain) hashes as an explicit
    plain always did (the committed plain rows keep theirs: test_every_committed_point_keeps_its_hash). fp8 reads
    its own e4m3 copy whatever the value: the option never enters an fp8 point's hash."""
    from omegaconf import OmegaConf

    from conftest import compose_cfg

    def h(*over: str) -> str:
        c = OmegaConf.to_container(compose_cfg("device=cpu", "shape=tiny", f"precision={precision}", *over),
                                   resolve=True)
        apply_aliases(c)
        return config_hash(c, make_case(c, ep_size=1, device="cpu"))

    default, tiled, plain, owned = h(), h("mok_hopper.weights=tiled"), h("mok_hopper_weights=plain"), h(
        "mok_hopper.weights=owned")
    assert h("mok_hopper_weights=tiled") == tiled and h("mok_hopper.weights=plain") == plain == default
    if precision == "bf16":
        assert len({tiled, plain, owned}) == 3
    else:
        assert tiled == plain == owned


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_mok_hopper_rows_enter_hashes_only_away_from_the_old_default(precision):
    """``mok_hopper.rows`` came after points were measured at ``padded``, then its default moved to ``packed``: a
    point at padded keeps the hash it had without the option, and the default (packed) hashes as an explicit packed
    always did (the rows of kmem-*_h100x1_20261208 ran with an explicit packed), in bf16 and fp8 alike."""
    from omegaconf import OmegaConf

    from conftest import compose_cfg

    def h(*over: str) -> str:
        c = OmegaConf.to_container(compose_cfg("device=cpu", "shape=tiny", f"precision={precision}", *over),
                                   resolve=True)
        apply_aliases(c)
        return config_hash(c, make_case(c, ep_size=1, device="cpu"))

    c = OmegaConf.to_container(compose_cfg("device=cpu", "shape=tiny", f"precision={precision}"), resolve=True)
    apply_aliases(c)
    c["mok_hopper"].pop("rows")  # a configuration stored before the option existed ran padded
    before = config_hash(c, make_case(c, ep_size=1, device="cpu"))
    default, padded, packed = h(), h("mok_hopper.rows=padded"), h("mok_hopper_rows=packed")
    assert padded == before != packed == default


def test_an_option_whose_default_changed_keeps_the_old_default_out_of_the_hash(monkeypatch):
    """``unhashed``: an option whose default moves after points were measured names the old default. Every explicit
    value then hashes as before the move (the new default as it did when it was one value among others), and a
    configuration stored before the option existed hashes as the old default it ran at."""
    import dataclasses

    import harness.config.backend_options as bo
    from contract.options import option
    from mok_kernels.mok_hopper.options import FORWARDS, WEIGHTS

    def entries(*weights: str) -> tuple:
        node = {"forward": "save_h", **({"weights": weights[0]} if weights else {})}
        return bo.hash_entries({"mok_hopper": node}, "bf16")

    before = {w: entries(w) for w in WEIGHTS}
    stored_before_option = entries()
    assert stored_before_option == before["tiled"] != before["plain"]
    moved = dataclasses.make_dataclass("Moved", [
        ("forward", str, option("save_h", choices=FORWARDS, alias="mok_hopper_forward")),
        ("weights", str, option("plain", choices=WEIGHTS, alias="mok_hopper_weights", unhashed="tiled"))])
    real = bo.options_class
    monkeypatch.setattr(bo, "options_class", lambda b: moved if b == "mok_hopper" else real(b))
    assert {w: entries(w) for w in WEIGHTS} == before
    assert entries() == before["tiled"]
    with pytest.raises(ValueError, match="unhashed"):
        option("plain", choices=WEIGHTS, unhashed="tiled", hash_default=True)
