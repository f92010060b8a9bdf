"""That the packages the harness imports are this project's: the package index has other distributions with the
same import names (``baselines``: OpenAI's RL baselines; ``harness``: a framework for serverless-style services), and
where one of them is earlier on the path Python imports it instead. The commands (``harness.run``, ``report``, ``gate``,
``compare``, ``run_meta``, ``slurm``) check this first: one line naming the clash and the fix, and exit code 2
(docs/backends.md, "Import names").

A clash of ``harness`` itself cannot be caught here (the other ``harness`` is what Python runs then): ``python -m
harness.run`` then fails with "No module named harness.run".
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]  # where this project's packages lie (a checkout or site-packages)
OWN = ("contract", "baselines", "mok_kernels", "mok_tools")  # harness's sibling packages
NEEDED = ("contract", "baselines", "mok_kernels")  # what the harness and its backends import (the tools import them)


def origin(name: str) -> Optional[Path]:
    """Where ``import name`` would load the package from (its folder), without importing it; None if absent."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.origin and spec.origin not in ("namespace", "built-in", "frozen"):
        return Path(spec.origin).resolve().parent if spec.submodule_search_locations else Path(spec.origin).resolve()
    locations = list(spec.submodule_search_locations or [])
    return Path(locations[0]).resolve() if locations else None


def foreign() -> list[tuple[str, Path]]:
    """The project's package names that resolve outside this project: (name, where it would load from)."""
    out = []
    for name in OWN:
        if name not in NEEDED and not (ROOT / name).is_dir():
            continue  # a tree without the tools: another copy of them changes nothing the harness runs
        where = origin(name)
        if where is not None and where != ROOT / name:
            out.append((name, where))
    return out


def _distribution(name: str) -> Optional[str]:
    """The installed distribution other than mokbench that provides the import name, if any."""
    dists = [d for d in importlib.metadata.packages_distributions().get(name, []) if d.lower() != "mokbench"]
    return dists[0] if dists else None


def clash() -> Optional[str]:
    """One line naming the first foreign package and the fix, or None where every package is this project's."""
    found = foreign()
    if not found:
        return None
    name, where = found[0]
    dist = _distribution(name)
    fix = (f"`pip uninstall {dist}` (it shares the import name), or install mokbench in a virtual environment of "
           f"its own" if dist else
           f"rename or move that {name}, or run from the mokbench checkout's root or a virtual environment of its own")
    return (f"mokbench: `import {name}` loads {where}{f' (distribution {dist})' if dist else ''}, not mokbench's "
            f"{ROOT / name}: {fix}")


def exit_on_clash() -> None:
    """The commands' first step: on a clash, its line on stderr and exit code 2, before anything runs."""
    line = clash()
    if line:
        print(line, file=sys.stderr)
        sys.exit(2)
