"""Find, for every config_hash of the committed rows (results/runs), the launch settings the rows do not record
(ep_size given or left to the machine, compile, compile_mode, comm_sms, fp8_gemm, te_fp8_recipe, mok_hopper_forward)
that make the hash function of a given checkout reproduce the stored hash. Run it with that checkout first on
PYTHONPATH (here: the commit before the backend options moved, a61a044):

    PYTHONPATH=<checkout> python find_knobs.py <results/runs> > knobs.json

Writes JSON: hash -> the settings, or null where no candidate reproduced it. tests/test_config_hash.py rebuilds each
point from its row and these settings, and checks that today's hash function gives the stored hash."""

import itertools
import json
import math
import re
import sys

import pandas as pd

import harness.config as hc
from harness import results

make_case = hc.make_case  # the checkout before the options moved has it here


def _none(v):
    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
        return None
    return v.item() if hasattr(v, "item") else v


def routing_parts(label):
    if label == "uniform":
        return dict(name="uniform", routing="uniform")
    if m := re.fullmatch(r"zipf\(s=(.*)\)", label):
        return dict(name="zipf", routing="zipf", zipf_exponent=float(m[1]))
    if m := re.fullmatch(r"hot_experts\(f=(.*),x(.*)\)", label):
        return dict(name="hot_experts", routing="hot_experts", hot_fraction=float(m[1]), hot_ratio=float(m[2]))
    m = re.fullmatch(r"hot_rank\(r=(.*),x(.*)\)", label)
    return dict(name="hot_rank", routing="hot_rank", hot_rank=int(m[1]), hot_ratio=float(m[2]))


def point(r, knobs):
    rp = routing_parts(r["routing"])
    wl = hc.to_container(hc.load_group_option("workload", rp["name"]))
    wl.update(rp, tokens_per_gpu=int(r["tokens_per_gpu"]), seed=int(r["seed"]))
    prec = hc.to_container(hc.load_group_option("precision", r["precision"]))
    prec.update(atol=float(r["atol"]), rtol=float(r["rtol"]))
    name = r["shape"].split("@")[0]
    try:
        shape = hc.to_container(hc.load_group_option("shape", name))
    except hc.ConfigError:
        shape = hc.to_container(hc.load_group_option("shape", "custom"))
        shape["name"] = name
    if shape["num_experts"] == "???":
        shape["num_experts"] = int(r["num_experts"])
    pl = _none(r["published_local_experts"])
    sl = _none(r["swiglu_limit"])
    shape.update(hidden=int(r["hidden"]), ffn=int(r["ffn"]), topk=int(r["topk"]), shared_expert=bool(r["shared_expert"]),
                 local_experts=int(r["local_experts"]) if r["experts_override"] else None,
                 published_local_experts=None if pl is None else int(pl), swiglu_limit=None if sl is None else float(sl))
    c = dict(shape=shape, workload=wl, precision=prec, device=r["device"], ranks_per_gpu=1,
             ep_size=int(r["ep_size"]) if knobs["ep_size_given"] else None, compile=knobs["compile"],
             compile_mode=knobs["compile_mode"], comm_sms=_none(r["comm_sms"]) if knobs["comm_sms_given"] else None,
             fp8_gemm=knobs["fp8_gemm"], te_fp8_recipe=knobs["te_fp8_recipe"],
             mok_hopper_forward=knobs["mok_hopper_forward"])
    return c


def candidates(r):
    fp8 = r["precision"] == "fp8"
    cs = _none(r["comm_sms"]) is not None
    for ep, comp, mode, csms, g, te, mf in itertools.product(
            (False, True), (None, True, False), hc.COMPILE_MODES, (False, True) if cs else (False,),
            ("auto", "blockwise", "blockwise_loop", "rowwise", "emulated") if fp8 else ("auto",),
            ("blockwise", "tensorwise", "delayed") if fp8 else ("blockwise",), ("save_h", "recompute", "inference")):
        yield dict(ep_size_given=ep, compile=comp, compile_mode=mode, comm_sms_given=csms, fp8_gemm=g,
                   te_fp8_recipe=te, mok_hopper_forward=mf)


def main(root):
    d = results.load(root)
    out = {}
    for h, g in d.groupby("config_hash"):
        r = g.iloc[0]
        out[h] = None
        for k in candidates(r):
            c = point(r, k)
            if hc.config_hash(c, make_case(c, ep_size=int(r["ep_size"]), device=r["device"])) == h:
                out[h] = k
                break
        print(h, "found" if out[h] else "NOT FOUND", file=sys.stderr)
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main(sys.argv[1])
