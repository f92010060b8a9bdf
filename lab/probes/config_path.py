"""The configuration's path through the harness on one tiny CPU run: which modules it passes through, how often it
comes back to a module it had left, and how often it changes form.

    python3 lab/probes/config_path.py            # prints the counts and the path

The run is one rank in this process, set up as torchrun sets up a rank (RANK=0, WORLD_SIZE=1: the runner runs the
worker here, so the launching side and the rank side are one path); nccl, forward only, tiny shape, 64 tokens.

Method (sys.setprofile over the whole run):
- a *config object* is the composed DictConfig, a plain dict holding the configuration's groups (``shape``,
  ``workload``, ``precision``, ``timing`` keys), the typed configuration (an instance of
  ``harness.config.schema.BenchConfig``), a ``harness.config.point.Point``, or a dict or dataclass holding one of
  these as a direct value (the rank payload, the runner's ``PointContext``); parts of it (the shape dict, the Case)
  are not followed;
- the *path*: for every call of a function of the project's packages (``harness``, ``contract``) that receives a
  config object as an argument other than ``self`` (a method reading its own object passes nothing on), the module
  of the called function, with consecutive repeats collapsed;
- *modules*: the distinct modules on the path; *returns*: the entries of the path whose module is already on it
  earlier (the config comes back to a module it had left);
- *forms*: the kind (DictConfig, dict, typed) of each new whole configuration a project function returns when given
  a config object (``to_container``, ``typed_config``, ``as_dict``, ``Point.build``'s typed config...), in order;
  *form changes*: the kind differs from the previous one's, starting from the composed DictConfig.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    from omegaconf import DictConfig

    from conftest import cpu_cfg  # the tests' tiny CPU configuration
    from harness.config.point import Point
    from harness.config.schema import BenchConfig
    from harness.measure.dist import free_port

    groups = {"shape", "workload", "precision", "timing"}

    def whole(v) -> str:
        """The kind of a whole configuration ``v``, or ''."""
        if isinstance(v, DictConfig) and "shape" in v:
            return "DictConfig"
        if type(v) is dict and groups <= v.keys():
            return "dict"
        if isinstance(v, BenchConfig):
            return "typed"
        if isinstance(v, Point):
            return "typed"
        return ""

    def holds(v) -> bool:
        if whole(v):
            return True
        if type(v) is dict:
            return any(whole(x) for x in v.values())
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return any(whole(getattr(v, f.name, None)) for f in dataclasses.fields(v))
        return False

    path: list[str] = []
    handoffs: list[str] = []  # the path of hand-offs only: calls from another module
    calls: list[str] = []
    forms: list[str] = []
    seen: set[int] = set()
    pending: dict[int, bool] = {}  # frame id -> received a config object

    def prof(frame, event, arg):
        mod = frame.f_globals.get("__name__", "")
        if not mod.startswith(("harness", "contract")):
            return
        if event == "call":
            code = frame.f_code
        n = code.co_argcount + code.co_kwonlyargcount if event == "call" else 0
        if event == "call":
            names = code.co_varnames[:n + bool(code.co_flags & 4) + bool(code.co_flags & 8)]
            loc = frame.f_locals
            held = [name for name in names if holds(loc.get(name))]
            if held:
                pending[id(frame)] = True  # its return may be a new form (``as_dict`` reads its own object)
            if any(name != "self" for name in held):
                up = frame.f_back  # the nearest caller of the project's (dataclasses.replace calls __init__)
                while up is not None and not up.f_globals.get("__name__", "").startswith(("harness", "contract")):
                    up = up.f_back
                caller = up.f_globals.get("__name__", "") if up is not None else ""
                calls.append(f"{mod}.{code.co_name}" + ("" if caller == mod else f"  (from {caller})"))
                if not path or path[-1] != mod:
                    path.append(mod)
                if caller != mod and (not handoffs or handoffs[-1] != mod):
                    handoffs.append(mod)
        elif event == "return" and pending.pop(id(frame), False):
            kind = whole(arg)
            obj = arg.config if isinstance(arg, Point) else arg
            if kind and id(obj) not in seen:
                seen.add(id(obj))
                forms.append(f"{kind} <- {mod}.{frame.f_code.co_name}")

    out = Path(tempfile.mkdtemp()) / "results"
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cfg = cpu_cfg(out, "backends=[nccl]", "directions=[fwd]", "ep_size=1")
    seen.add(id(cfg))
    from harness.measure.runner import run_benchmark

    sys.setprofile(prof)
    try:
        df = run_benchmark(cfg)
    finally:
        sys.setprofile(None)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    assert len(df) == 1 and df.status.iloc[0] == "ok", df[["status", "error"]]

    def returns_of(p: list[str]) -> list[str]:
        return [m for i, m in enumerate(p) if m in p[:i]]

    kinds = ["DictConfig"] + [f.split(" <-")[0] for f in forms]
    changes = sum(a != b for a, b in zip(kinds, kinds[1:]))
    print(f"form changes: {changes}")
    for name, p in (("every call", path), ("hand-offs", handoffs)):
        print(f"{name}: modules: {len(set(p))}  returns: {len(returns_of(p))}")
        print("  path:", " -> ".join(m.removeprefix("harness.") for m in p))
        print("  returns to:", ", ".join(m.removeprefix("harness.") for m in returns_of(p)))
    print("forms: DictConfig (composed) ->", " -> ".join(forms))
    print("calls:", len(calls))
    if "-v" in sys.argv:
        print("\n".join(calls))


if __name__ == "__main__":
    main()
