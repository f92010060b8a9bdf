"""Hydra's run folder of a plain run that the harness refuses: removed, so that a refusal writes nothing anywhere.

Hydra makes the run folder (``hydra.run.dir``, by default ``outputs/<date>/<time>``), saves ``.hydra/config.yaml``,
``hydra.yaml`` and ``overrides.yaml`` in it and opens the job's log (``<job name>.log``) before the task function
runs, and some checks need the composed configuration that only the task function gets. :class:`RunFolder`, a Hydra
callback (``configs/config.yaml``: ``hydra.callbacks``), notes before Hydra makes anything which folders it will
make; :func:`discard` removes Hydra's files from them and the folders left empty, the made ones only, where the task
function refuses the configuration. A sweep is validated before Hydra makes its folder
(:class:`harness.launch.cli.SweepValidationMixin`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback

HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")  # what Hydra saves in <run folder>/<output_subdir>

_made: Optional[tuple[Path, Path]] = None  # (the run folder, the outermost folder Hydra makes for it)


def first_missing(folder: Path) -> Optional[Path]:
    """The outermost folder of ``folder``'s path that does not exist yet (None: ``folder`` exists)."""
    missing = None
    for p in (folder, *folder.parents):
        if p.exists() or p.is_symlink():
            break
        missing = p
    return missing


class RunFolder(Callback):
    """Notes, before Hydra makes the run folder of a plain run, the outermost folder it will make."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        global _made
        from omegaconf import OmegaConf

        folder = Path(str(OmegaConf.select(config, "hydra.run.dir"))).absolute()
        top = first_missing(folder)
        _made = (folder, top) if top is not None else None


def discard(config: Any = None) -> None:
    """Remove what Hydra wrote for this run (its saved config and the job's log) and the folders it made, where
    they hold nothing else. Nothing where the run folder existed before the run."""
    global _made
    if _made is None:
        return
    folder, top = _made
    _made = None
    from hydra.core.hydra_config import HydraConfig

    try:
        hc = HydraConfig.get()
        subdir, job = hc.output_subdir, hc.job.name
    except ValueError:
        subdir, job = ".hydra", None
    for handler in list(logging.root.handlers):  # the job's log file is open: close it before removing it
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).is_relative_to(folder):
            logging.root.removeHandler(handler)
            handler.close()
    files = [folder / subdir / n for n in HYDRA_FILES] if subdir else []
    files += [folder / f"{job}.log"] if job else []
    for f in files:
        if f.is_file():
            f.unlink()
    for d in ([folder / subdir] if subdir else []) + [folder, *folder.parents]:
        if not d.is_relative_to(top):
            break
        try:
            d.rmdir()  # only an empty folder
        except OSError:
            break
