"""What the command line says about a configuration that can never run: one line naming the fix, and exit code 2.

Hydra rejects some inputs while it composes the configuration, before the task function runs: an unknown group
option (``shape=kimi``), a misspelled key (``ep_sise=2``), a value of the wrong type
(``workload.tokens_per_gpu=1.5``), an override it cannot parse. :func:`hydra_error_line` turns those errors into
one line that lists the valid choices or the closest key; ``harness.run`` prints it and exits 2.

Before Hydra parses anything, :func:`argv_line` words what its argument parser would refuse (a flag such as ``-m``
after the overrides) as the same command in the order that works. A ``hydra.launcher.<key>`` outside a sweep on a
mokbench launcher, or one the launcher does not take, gets the launcher presets or the launcher's keys; in the main,
:func:`check_command_line` refuses what needs the command line to see (a launcher option in a plain run, an option
and a key that replaces it).

A sweep (``-m``) is validated point by point before any point runs, and before Hydra makes the sweep folder
(:class:`SweepValidationMixin`, the sweeper ``configs/hydra/sweeper/mokbench.yaml`` that ``configs/config.yaml``
selects): composition errors and everything a run checks before it starts, for every point, one line per problem
(naming the points that have it, ``all N sweep points`` where every one does), then exit 2 with nothing run or
written. With the mokbench Slurm / local / node launchers a point is checked for the job it will run in
(:func:`harness.launch.slurm_plan.plan_point`); with Hydra's basic launcher, which runs the points one after the other
in this process, exactly as a plain run checks it (:func:`harness.measure.runner.prepare`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import re
import shlex
import sys
from typing import Any, Iterator, NoReturn, Optional, Sequence

from omegaconf import DictConfig, open_dict, read_write

from harness.config.schema import CONFIG_DIR, ConfigError

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
        if str(cause.full_key).startswith("hydra.launcher."):
            return _launcher_key(str(cause.full_key), getattr(cause, "object_type", None))
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
    from harness.config.schema import BenchConfig, PrecisionConfig, ShapeConfig, TimingConfig, WorkloadConfig

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


def launcher_presets() -> list[str]:
    """The launcher presets (configs/hydra/launcher/*.yaml)."""
    return sorted(p.stem for p in (CONFIG_DIR / "hydra" / "launcher").glob("*.yaml"))


def launcher_needs_sweep(override: str) -> str:
    """The line for a ``hydra.launcher.<key>`` or ``hydra/launcher=`` override where no mokbench launcher runs a
    sweep (a plain run, or a sweep on Hydra's basic launcher)."""
    override = override.lstrip("+~")
    presets = ", ".join(launcher_presets())
    if override.startswith("hydra/launcher="):
        return (f"{override} picks the launcher of a sweep: put -m first (python -m harness.run -m {override} ...); "
                f"presets: {presets}")
    return (f"{override.partition('=')[0]} is an option of a mokbench sweep launcher: put -m first and pick a "
            f"launcher (python -m harness.run -m hydra/launcher=<preset> {override} ...); presets: {presets}")


def _launcher_key(key: str, schema: Any) -> str:
    from harness.config.launcher_options import LAUNCHER_SCHEMAS, launcher_keys

    executor = next((x for x, s in LAUNCHER_SCHEMAS.items() if s is schema), None)
    if executor is None:  # Hydra's basic launcher (no -m hydra/launcher=...): it has no options
        given = [a for a in sys.argv[1:] if a.lstrip("+~").startswith(f"{key}=")]
        return launcher_needs_sweep(given[-1] if given else f"{key}=...")
    keys = launcher_keys(schema)
    close = difflib.get_close_matches(key.rpartition(".")[2], keys, n=1, cutoff=0.7)
    hint = f" (did you mean hydra.launcher.{close[0]}?)" if close else ""
    return f"unknown key '{key}'{hint}; the keys of the mokbench_{executor} launcher: {', '.join(keys)}"


class _ArgvError(Exception):
    pass


def argv_line(argv: Sequence[str]) -> Optional[str]:
    """One line for a command line Hydra's argument parser refuses (None where it parses): a Hydra flag after the
    overrides (``results_dir=R -m a=1,2``) gets the same command with the flags first."""
    from hydra._internal.utils import get_args_parser

    argv = list(argv)
    if "--version" in argv:  # argparse prints the version and exits while parsing
        return None
    parser = get_args_parser()

    def fail(message: str) -> NoReturn:
        raise _ArgvError(message)

    parser.error = fail  # type: ignore[method-assign]  (argparse prints usage and exits where it refuses)
    try:
        extra = parser.parse_known_args(argv)[1]
        if not extra:
            return None
        parser.parse_intermixed_args(argv)  # the same arguments parse with the flags anywhere: only the order is off
    except _ArgvError as e:
        return f"{e} (python -m harness.run --help lists the flags; overrides are key=value)"
    flags: list[str] = []
    overrides: list[str] = []
    late: list[str] = []
    i = 0
    while i < len(argv):
        name = argv[i].partition("=")[0]
        action = parser._option_string_actions.get(name) if argv[i].startswith("-") else None
        if action is None:
            overrides.append(argv[i])
            i += 1
            continue
        takes = "=" not in argv[i] and i + 1 < len(argv) and (
            action.nargs is None or (action.nargs == "?" and argv[i + 1] in (action.choices or ())))
        if overrides:
            late.append(argv[i])
        flags += argv[i:i + 1 + takes]
        i += 1 + takes
    named = ", ".join(f"{f} (or --multirun)" if f == "-m" else f"{f} (or -m)" if f == "--multirun" else f
                      for f in dict.fromkeys(late))
    return f"put {named} before the overrides: python -m harness.run {shlex.join(flags + overrides)}"


def check_command_line(cfg: DictConfig) -> None:
    """The checks of a run (in the Hydra main) that need its command line, not only its config: a launcher option
    without a sweep, and a group option and a key it sets given with different values (``check_option_conflicts``).
    Raises :class:`ConfigError`."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from harness.config.validate import check_option_conflicts

    hc = HydraConfig.get()
    if hc.mode == RunMode.RUN:
        for o in hc.overrides.hydra:
            if o.lstrip("+~").startswith(("hydra.launcher.", "hydra/launcher=")):
                raise ConfigError(launcher_needs_sweep(o))
    check_option_conflicts(cfg, list(hc.overrides.task))


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
        problems.append((initial_job_idx + i, labels[i], msg))
    if problems:
        reject(sweep_problem_lines(problems, len(job_overrides)))


def sweep_problem_lines(problems: Sequence[tuple[int, str, str]], points: int) -> list[str]:
    """One line per problem of a sweep (``problems``: point number, label, message), naming the points that have it:
    ``all N sweep points: ...`` where every one of the ``points`` does."""
    by_message: dict[str, list[tuple[int, str]]] = {}
    for num, label, msg in problems:
        by_message.setdefault(msg, []).append((num, label))
    lines = []
    for msg, where in by_message.items():
        if len(where) == points > 1:
            lines.append(f"all {points} sweep points: {msg}")
        else:
            named = ", ".join(f"#{num} {label if label.startswith('(') else f'({label})'}" for num, label in where)
            lines.append(f"sweep point{'s' if len(where) > 1 else ''} {named}: {msg}")
    return lines


def check_local_point(config: DictConfig) -> None:
    """Check one composed sweep point (``hydra`` node included) exactly as ``harness.run`` would check it here, and
    its run folder as the sweep's first point will find it."""
    from harness.measure.runner import prepare
    from harness.config.validate import check_new_run, check_option_conflicts, given_run_id, run_id_for_sweep

    task_cfg = copy.deepcopy(config)
    with hydra_config(config):
        with read_write(task_cfg), open_dict(task_cfg):
            del task_cfg["hydra"]
            generated = given_run_id(task_cfg)[0] is None
            run_id_for_sweep(task_cfg)
        point = prepare(task_cfg)[0]
    check_option_conflicts(task_cfg, list(config.hydra.overrides.task))
    check_new_run(point.config, generated_from=str(config.hydra.sweep.dir) if generated else None)


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

    def sweep(self, arguments: list[str]) -> Any:
        """Validate every point, then sweep as Hydra's basic sweeper does; a sweep refused here leaves no sweep folder
        (Hydra makes it, and saves multirun.yaml in it, before it validates the first batch)."""
        from hydra.core.override_parser.overrides_parser import OverridesParser

        params = self._parse_config()  # type: ignore[attr-defined]
        params.extend(arguments)
        parsed = OverridesParser.create(config_loader=self.hydra_context.config_loader).parse_overrides(params)
        batches = self.split_arguments(parsed, self.max_batch_size)  # type: ignore[attr-defined]
        self.validate_batch_is_legal([list(o) for b in batches for o in b])
        return super().sweep(arguments)  # type: ignore[misc]

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        if getattr(self, "_mokbench_validated", False):
            return
        self._mokbench_validated = True
        check_sweep(self.hydra_context.config_loader, self.config, self.launcher, [list(o) for o in batch])
