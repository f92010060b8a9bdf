"""Find, for every config_hash of the committed rows (results/runs), the launch settings the rows do not record
(ep_size given or left to the machine, compile, compile_mode, comm_sms, fp8_gemm, te_fp8_recipe, mok_hopper_forward)
that make the hash function of a given checkout reproduce the stored hash. Run it with that checkout first on
PYTHONPATH (here: the commit before the backend options moved, a61a044):

    PYTHONPATH=<checkout> python find_knobs.py <results/runs> > knobs.json

Writes JSON: hash -> the settings, or null where no candidate reproduced it (eight fp8 points of 2026-11-30 were
then searched again with the hash function without fp8_gemm's entry, and marked ``older_hash_function``).
tests/test_config_hash.py rebuilds each point from its row and these settings (tests/committed_points.py, as here)
and checks that today's hash function gives the stored hash."""

import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: committed_points

import harness.config.schema as hc  # noqa: E402
from committed_points import row_config, value  # noqa: E402
from harness.core import results  # noqa: E402


def candidates(r):
    fp8 = r["precision"] == "fp8"
    cs = value(r["comm_sms"]) is not None
    for ep, comp, mode, csms, g, te, mf in itertools.product(
            (False, True), (None, True, False), hc.COMPILE_MODES, (False, True) if cs else (False,),
            ("auto", "blockwise", "blockwise_loop", "rowwise", "emulated") if fp8 else ("auto",),
            ("blockwise", "tensorwise", "delayed") if fp8 else ("blockwise",), ("save_h", "recompute", "inference")):
        yield dict(ep_size_given=ep, compile=comp, compile_mode=mode, comm_sms_given=csms, fp8_gemm=g,
                   te_fp8_recipe=te, mok_hopper_forward=mf)


def main(root):
    make_case = getattr(hc, "make_case", None)  # where the checkout before the options moved has it
    if make_case is None:
        from harness.config.point import make_case
    d = results.load(root)
    out = {}
    for h, g in d.groupby("config_hash"):
        r = g.iloc[0]
        out[h] = None
        for k in candidates(r):
            c = row_config(r, k)
            if hc.config_hash(c, make_case(c, ep_size=int(r["ep_size"]), device=r["device"])) == h:
                out[h] = k
                break
        print(h, "found" if out[h] else "NOT FOUND", file=sys.stderr)
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main(sys.argv[1])
