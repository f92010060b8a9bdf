"""What the command line says about a configuration that can never run: one line naming the fix, and exit code 2.

Hydra rejects some inputs while it composes the configuration, before the task function runs: an unknown group
option (``shape=kimi``), a misspelled key (``ep_sise=2``), a value of the wrong type
(``workload.tokens_per_gpu=1.5``), an override it cannot parse. :func:`hydra_error_line` turns those errors into
one line that lists the valid choices or the closest key; ``harness.run`` prints it and exits 2.

A sweep (``-m``) is validated point by point before any point runs (:class:`SweepValidationMixin`, the sweeper
``configs/hydra/sweeper/mokbench.yaml`` that ``configs/config.yaml`` selects): composition errors and everything a
run checks before it starts, for every point, each problem on its own line, then exit 2 with nothing run or
written. With the mokbench Slurm / local launchers a point is checked for the job it will run in
(:func:`harness.slurm.plan_point`); with Hydra's basic launcher, which runs the points one after the other in this
process, exactly as a plain run checks it (:func:`harness.runner.prepare`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import re
import sys
from typing import Any, Iterator, NoReturn, Optional, Sequence

from omegaconf import DictConfig, open_dict, read_write

from harness.config import CONFIG_DIR, ConfigError

GRAMMAR_URL = "https://hydra.cc/docs/advanced/override_grammar/basic/"


def hydra_error_line(e: BaseException) -> Optional[str]:
    """One line for an error Hydra or OmegaConf raised while composing the configuration; None for anything else."""
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

    if isinstance(e, MissingConfigException):
        return _missing_option(e)
    if isinstance(e, OverrideParseException):
        msg = _flat(e.message).split(" See https://")[0]  # Hydra's own pointer names an old version of the page
        return f"cannot parse the override '{e.override}': {msg}; the override syntax: {GRAMMAR_URL}"
    if not isinstance(e, (HydraException, OmegaConfBaseException)):
        return None
    cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else e
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and getattr(cause, "full_key", None):
        return _unknown_key(str(cause.full_key))
    if isinstance(cause, ValidationError) and getattr(cause, "full_key", None):
        return _bad_value(str(cause.full_key), cause)
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if cause is not e:
        lines += [ln.strip() for ln in str(cause).splitlines()[:1] if ln.strip()]
    return _flat("; ".join(lines)) or type(e).__name__


def point_error_line(e: BaseException) -> Optional[str]:
    """The line for why one sweep point cannot run: a :class:`ConfigError`'s message, or Hydra's composition error
    as :func:`hydra_error_line` words it; None for anything else (a bug: the caller raises it)."""
    return str(e) if isinstance(e, ConfigError) else hydra_error_line(e)


def group_options(group: str) -> list[str]:
    """The options of a config group: files under configs/<group>/ and ConfigStore entries (schemas left out)."""
    from hydra.core.config_store import ConfigStore

    names = {p.stem for p in (CONFIG_DIR / group).glob("*.yaml")}
    try:
        names |= {n.removesuffix(".yaml") for n in ConfigStore.instance().list(group)}
    except Exception:  # noqa: BLE001 - not a ConfigStore group
        pass
    return sorted(n for n in names if not n.startswith("base_"))


def _missing_option(e: Any) -> str:
    missing = str(getattr(e, "missing_cfg_file", "") or "")
    m = re.search(r"Could not (?:find|load) '([^']+)'", str(e))
    path = missing or (m.group(1) if m else "")
    group, _, name = path.rpartition("/")
    if not group:
        return _flat(str(e))
    options = sorted(n for n in (getattr(e, "options", None) or group_options(group))
                     if not n.startswith("base_"))
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    hint = f" (did you mean {group}={close[0]}?)" if close else ""
    return f"unknown {group} '{name}'{hint}: choose one of {', '.join(options)}"


def config_keys() -> list[str]:
    """Every key a mokbench config has, dotted (``ep_size``, ``shape.local_experts``, ...)."""
    from harness.config import BenchConfig, PrecisionConfig, ShapeConfig, TimingConfig, WorkloadConfig

    groups = {"shape": ShapeConfig, "workload": WorkloadConfig, "precision": PrecisionConfig, "timing": TimingConfig}
    keys = []
    for f in dataclasses.fields(BenchConfig):
        if f.name in groups:
            keys += [f"{f.name}.{g.name}" for g in dataclasses.fields(groups[f.name])]
        else:
            keys.append(f.name)
    return keys


def _unknown_key(key: str) -> str:
    keys = config_keys()
    parent, _, leaf = key.rpartition(".")
    siblings = [k for k in keys if k.rpartition(".")[0] == parent]
    # the closest key in the same place, else the same name in another place (local_experts -> shape.local_experts)
    close = difflib.get_close_matches(leaf, [k.rpartition(".")[2] for k in siblings], n=1, cutoff=0.7)
    if close:
        return f"unknown key '{key}': did you mean {parent + '.' if parent else ''}{close[0]}?"
    elsewhere = [k for k in keys if difflib.SequenceMatcher(None, leaf, k.rpartition(".")[2]).ratio() >= 0.85]
    if elsewhere:
        return f"unknown key '{key}': did you mean {elsewhere[0]}?"
    if parent and not siblings:
        return f"unknown key '{key}': '{parent}' has no keys of its own"
    where = f"under {parent}" if parent else "at the top level"
    return f"unknown key '{key}'; the keys {where}: {', '.join(k.rpartition('.')[2] for k in siblings)}"


_TYPE_WORDS = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "bool": "true or false",
               "String": "a string"}


def _bad_value(key: str, cause: Any) -> str:
    msg = _flat(str(getattr(cause, "msg", "") or cause).splitlines()[0] if str(cause) else "")
    m = re.search(r"could not be converted to (\w+)|is not a valid (\w+)", msg)
    kind = m and (m.group(1) or m.group(2))
    if kind in _TYPE_WORDS:
        value = getattr(cause, "value", None)
        got = f" (got {value})" if value is not None else ""
        return f"{key} must be {_TYPE_WORDS[kind]}{got}"
    return f"{key}: {msg}"


def _flat(text: str) -> str:
    return " ".join(str(text).split())


def reject(problems: Sequence[str]) -> NoReturn:
    """Print each problem on its own line and exit 2 (nothing has run)."""
    for p in problems:
        print(f"mokbench: invalid configuration: {p}", file=sys.stderr)
    sys.stderr.flush()
    sys.exit(2)


def check_sweep(loader: Any, master: DictConfig, launcher: Any, job_overrides: Sequence[Sequence[str]],
                initial_job_idx: int = 0) -> None:
    """Compose and validate every point of a sweep; on any problem print them all and exit 2.

    ``launcher.plan_points`` (the mokbench launchers) checks the points for the jobs they will run in; any other
    launcher runs the points in this process, so each is checked as a plain run checks it."""
    plan = getattr(launcher, "plan_points", None)
    if plan is not None:
        plan(job_overrides, initial_job_idx)  # prints and exits 2 on a problem
        return
    labels = point_labels(job_overrides)
    problems = []
    for i, overrides in enumerate(job_overrides):
        try:
            config = loader.load_sweep_config(master, list(overrides))
            check_local_point(config)
            continue
        except Exception as e:  # noqa: BLE001 - configuration and Hydra's composition errors; anything else: raise
            msg = point_error_line(e)
            if msg is None:
                raise
        problems.append(f"sweep point #{initial_job_idx + i} ({labels[i]}): {msg}")
    if problems:
        reject(problems)


def check_local_point(config: DictConfig) -> None:
    """Check one composed sweep point (``hydra`` node included) exactly as ``harness.run`` would check it here."""
    from harness.config import run_id_for_sweep
    from harness.runner import prepare

    task_cfg = copy.deepcopy(config)
    with hydra_config(config):
        with read_write(task_cfg), open_dict(task_cfg):
            del task_cfg["hydra"]
            run_id_for_sweep(task_cfg)
        prepare(task_cfg)


def point_labels(job_overrides: Sequence[Sequence[str]]) -> list[str]:
    """Each sweep point's overrides less those every point shares (and Hydra's own): what tells it from the others,
    in problem lines and job names."""
    from hydra.core.utils import filter_overrides

    lists = [filter_overrides(list(o)) for o in job_overrides]
    common = set.intersection(*(set(o) for o in lists)) if len(lists) > 1 else set()
    return [" ".join(o for o in ov if o not in common) or "(defaults)" for ov in lists]


@contextlib.contextmanager
def hydra_config(config: DictConfig) -> Iterator[None]:
    """HydraConfig set to one point's config, as Hydra's run_job sets it in the job (interpolations, run_id), to
    check the point as its job will run."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.instance()
    saved = hc.cfg
    hc.set_config(config)
    try:
        yield
    finally:
        hc.cfg = saved


class SweepValidationMixin:
    """Mixed in before Hydra's BasicSweeper (``hydra_plugins.mokbench_launcher.Sweeper``): every point of the sweep,
    in every batch, is validated before the first batch is launched."""

    overrides: Any
    config: Any
    launcher: Any
    hydra_context: Any

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        if getattr(self, "_mokbench_validated", False):
            return
        self._mokbench_validated = True
        every = [list(o) for b in (self.overrides or [batch]) for o in b]
        check_sweep(self.hydra_context.config_loader, self.config, self.launcher, every)
