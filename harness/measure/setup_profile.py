"""Where a backend's setup time goes: its construction, ``setup`` and checked first call under cProfile
(``profile_setup_dir=DIR``), the steps whose seconds a row's ``setup_s`` holds.

Why: ``setup_s`` is one number. SonicMoE's setup took 136-156 s on one H200 with every QuACK kernel already compiled
(run mok_hopper-bf16-fwd-bwd-qwen3_5_397b_h200x1_20261204-2), and that time could not be split from its rows. With a
folder set, each backend's setup on each rank leaves ``<stem>.prof`` (``python -m pstats`` or snakeviz read it) and
``<stem>.txt``, the functions with the most cumulative and the most own time. cProfile sees this process's main thread
only: time spent waiting on compile worker processes or threads shows up in the function that waits."""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
import re
from pathlib import Path
from typing import Iterator, Optional

TOP = 40  # functions listed in the text summary, per ordering


class SetupProfile:
    """One backend's setup steps on one rank, profiled into ``folder`` (None: a no-op)."""

    def __init__(self, folder: Optional[str], stem: str) -> None:
        self.folder = Path(folder) if folder else None
        self.stem = re.sub(r"[^A-Za-z0-9_.=-]+", "_", stem)
        self.prof = cProfile.Profile() if self.folder else None

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        """Profile the body (steps add up in one profile)."""
        if self.prof is None:
            yield
            return
        self.prof.enable()
        try:
            yield
        finally:
            self.prof.disable()

    def write(self) -> Optional[Path]:
        """Write ``<stem>.prof`` and ``<stem>.txt`` into the folder, once; the text's path, or None when off, empty or
        written already."""
        if self.prof is None:
            return None
        prof, self.prof = self.prof, None  # written once
        stats = pstats.Stats(prof)
        if not stats.stats:  # type: ignore[attr-defined]
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        stats.dump_stats(self.folder / f"{self.stem}.prof")
        text = io.StringIO()
        stats.stream = text  # type: ignore[attr-defined]
        text.write(f"{self.stem}: setup steps under cProfile, {stats.total_tt:.2f} s in all\n")  # type: ignore
        for key, what in (("cumulative", "most cumulative time"), ("tottime", "most own time")):
            text.write(f"\n== {TOP} functions with the {what} ==\n")
            stats.sort_stats(key).print_stats(TOP)
        path = self.folder / f"{self.stem}.txt"
        path.write_text(text.getvalue())
        return path
