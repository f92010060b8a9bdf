"""What the harness's ``python -m`` tools say about a bad command line, an output they cannot write, and long work.

* :class:`ArgumentParser`: an argument error is one line on stderr, ``harness.<tool>: <what is wrong>; <the fix or
  the valid values>``, and exit code 2 (argparse's own is a usage block of several lines); a missing positional
  argument is named with what it holds.
* :func:`dir_write_problem`, :func:`file_write_problem`: why an output folder or file cannot be written, found before
  the tool prints or writes anything (nothing is created by the check).
* :class:`Progress`: progress on stderr: a bar on a terminal, plain lines otherwise (logs, CI).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn, Optional, TextIO, Union

HELP_HINT = "--help lists the options"


def flat(text: Any) -> str:
    """``text`` on one line (an error message may hold newlines)."""
    return " ".join(str(text).split())


def fail(tool: str, message: Any) -> int:
    """Print ``<tool>: <message>`` as one line on stderr; returns exit code 2 for the caller to return."""
    print(f"{tool}: {flat(message)}", file=sys.stderr, flush=True)
    return 2


class ArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, ``harness.<tool>: <what is wrong>; <the fix>``, and exit 2.

    Subcommand parsers (``add_subparsers``) are of this class too."""

    @property
    def tool(self) -> str:
        """The tool's module, from ``prog`` (``python -m harness.compare`` -> ``harness.compare``)."""
        words = self.prog.split()
        return words[words.index("-m") + 1] if "-m" in words[:-1] else (words[0] if words else "harness")

    def error(self, message: str) -> NoReturn:
        print(f"{self.tool}: {self.explain(message)}", file=sys.stderr, flush=True)
        sys.exit(2)

    def explain(self, message: str) -> str:
        """argparse's error ``message`` as ``<what is wrong>; <the fix or the valid values>``."""
        message = flat(message)
        if m := re.fullmatch(r"the following arguments are required: (.+)", message):
            return self._missing(m.group(1).split(", "))
        if m := re.fullmatch(r"unrecognized arguments: (.+)", message):
            return self._unknown(m.group(1).split())
        if m := re.fullmatch(r"argument (\S+): (.+)", message):
            return self._bad_value(m.group(1), m.group(2))
        return f"{message}; {HELP_HINT}"

    # ---- the kinds of error

    def short_usage(self) -> str:
        """``prog POSITIONAL ... [options]`` on one line."""
        words = [self.prog]
        for a in self._actions:
            if a.option_strings:
                continue
            name = self._display(a)
            words.append(f"[{name} ...]" if a.nargs == "*" else f"[{name}]" if a.nargs == "?"
                         else f"{name} ..." if a.nargs == "+" else name)
        return " ".join(words) + " [options]"

    def _missing(self, names: list[str]) -> str:
        parts = []
        for name in names:
            a = self._action(name)
            shown = self._display(a) if a is not None else name
            what = _help_text(a)
            if a is not None and a.choices and not a.option_strings:
                what = "one of " + ", ".join(map(str, a.choices))
            parts.append(f"{shown} ({what})" if what else shown)
        return f"missing {' and '.join(parts)}; usage: {self.short_usage()} ({HELP_HINT})"

    def _unknown(self, args: list[str]) -> str:
        opts = [a for a in args if a.startswith("-")]
        if not opts:
            return (f"unexpected argument{'s' if len(args) > 1 else ''} {' '.join(args)}; usage: "
                    f"{self.short_usage()}")
        known = [s for a in self._actions for s in a.option_strings]
        hints = []
        for o in opts:
            close = difflib.get_close_matches(o.split("=")[0], known, n=1, cutoff=0.7)
            if close:
                hints.append(f"{close[0]}" + (f" for {o}" if len(opts) > 1 else ""))
        head = f"unknown option{'s' if len(opts) > 1 else ''} {' '.join(opts)}"
        return f"{head}; {'did you mean ' + ', '.join(hints) + '? ' if hints else ''}{HELP_HINT}"

    def _bad_value(self, name: str, msg: str) -> str:
        a = self._action(name)
        if m := re.fullmatch(r"invalid choice: (.+?) \(choose from .*\)", msg):
            choices = ", ".join(map(str, a.choices)) if a is not None and a.choices else ""
            if isinstance(a, argparse._SubParsersAction):
                return f"{m.group(1)} is not a command; choose one of {choices}"
            return f"{name} {m.group(1)} is not one of its choices; choose one of {choices}"
        if m := re.fullmatch(r"invalid (\w+) value: (.+)", msg):
            kind, value = m.group(1), m.group(2)
            want = {"float": "a number", "int": "a whole number"}.get(kind)
            if want:
                example = f", e.g. {name.split('/')[0]} {a.default}" if a is not None and a.default is not None \
                    else ""
                return f"{name} {value} is not {want}; give {want}{example}"
            return f"{name} {value} is not a valid value; {_help_text(a) or HELP_HINT}"
        if msg.startswith("expected ") and "argument" in msg:
            metavar = (a.metavar or a.dest.upper()) if a is not None else "VALUE"
            return f"{name} needs a value; give {name.split('/')[0]} {metavar} ({_help_text(a) or HELP_HINT})"
        if m := re.fullmatch(r"not allowed with argument (\S+)", msg):
            return f"{name} and {m.group(1)} cannot be given together; give one of them"
        if re.fullmatch(r"ignored explicit argument .+", msg):
            return f"{name} takes no value; give {name.split('/')[0]} alone"
        head = msg if msg.startswith(name.split("/")[0]) else f"{name}: {msg}"  # an ArgumentTypeError's own words
        return head if ";" in msg else f"{head}; {HELP_HINT}"

    def _action(self, name: str) -> Optional[argparse.Action]:
        for a in self._actions:
            if name in ("/".join(a.option_strings), *a.option_strings, a.dest, str(a.metavar)):
                return a
        return None

    @staticmethod
    def _display(a: argparse.Action) -> str:
        if a.option_strings:
            return a.option_strings[0]
        if a.metavar:
            return str(a.metavar)
        return "COMMAND" if a.choices and isinstance(a, argparse._SubParsersAction) else a.dest.upper()


def _help_text(a: Optional[argparse.Action]) -> str:
    """An action's help, first clause, without argparse's %-escapes."""
    if a is None or not a.help or a.help == argparse.SUPPRESS:
        return ""
    text = flat(a.help).replace("%%", "%")
    return text.split("; ")[0]


# ---------------------------------------------------------------------------------------------------------------
# outputs


def dir_write_problem(path: Union[str, Path]) -> Optional[str]:
    """Why files cannot be written in the folder ``path`` (made if missing), or None: it or the folder it would be
    made under is a file, or the nearest existing folder cannot be written (probed with a temporary file, removed at
    once; nothing is created)."""
    p = Path(path)
    existing = p
    while not existing.exists() and existing != existing.parent:
        if existing.is_symlink():  # a dangling link: mkdir would fail on it
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        return "is a file" if existing == p else f"is under {existing}, which is a file"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        where = "" if existing == p else f" (it would be made in {existing})"
        return f"cannot be written{where}: {e.strerror or e}"
    return None


def file_write_problem(path: Union[str, Path]) -> Optional[str]:
    """Why the file ``path`` cannot be written (its folder made if missing), or None: it is a folder, its folder
    cannot be made or written, or the file exists and cannot be opened for writing (opened without truncating)."""
    p = Path(path)
    if p.is_dir():
        return "is a folder"
    if p.exists():
        try:
            with open(p, "r+b"):
                pass
        except OSError as e:
            return f"cannot be written: {e.strerror or e}"
        return None
    why = dir_write_problem(p.parent)
    return None if why is None else f"cannot be written: its folder {p.parent} {why}"


# ---------------------------------------------------------------------------------------------------------------
# progress


class Progress:
    """Progress of a long command on ``stream`` (stderr): on a terminal a bar per counted stage (tqdm; erased when
    the stage ends), otherwise plain lines: each :meth:`note`, and for a counted stage its first step, every
    ``every``-th step and a closing line. ``enabled=False`` prints nothing."""

    def __init__(self, stream: Optional[TextIO] = None, *, tty: Optional[bool] = None, every: int = 10,
                 enabled: bool = True):
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty
        self.every = max(1, every)
        self.enabled = enabled
        self._bar: Any = None
        self._stage = ""
        self._t0 = 0.0

    def note(self, text: str) -> None:
        """One line (between stages)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def start(self, stage: str, total: int, intro: str = "") -> None:
        """A stage of ``total`` steps begins (``stage`` names a step: ``rendering chart``); ``intro``: a line to
        print first where there is no bar."""
        self.close()
        self._stage, self._t0 = stage, time.monotonic()
        if not self.enabled:
            return
        if self.tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=stage, file=self.stream, leave=False, dynamic_ncols=True)
        elif intro:
            self.note(intro)

    def step(self, i: int, total: int, label: str = "") -> None:
        """Step ``i`` of ``total`` (1-based) begins; ``label`` names it."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.n = i - 1
            self._bar.set_postfix_str(label[:60], refresh=True)
        elif i == 1 or i % self.every == 0 or i == total:
            self.note(f"{self._stage} {i}/{total}" + (f": {label}" if label else ""))

    def close(self, summary: str = "") -> None:
        """End the stage (erasing its bar); ``summary`` (``{s}`` is replaced by the seconds it took) as a line."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if summary:
            self.note(summary.replace("{s}", f"{time.monotonic() - self._t0:.0f}"))

    def reader(self, stage: str) -> Any:
        """A ``progress(i, n, path)`` callback for :func:`harness.core.results.load`: a bar on a terminal (erased when
        done), nothing otherwise (a line printed while reading would precede the one-line error a damaged file
        gets)."""

        def cb(i: int, n: int, path: Any) -> None:
            if not (self.enabled and self.tty):
                return
            if i == 1:
                self.start(stage, n)
            self.step(i, n, Path(str(path)).name)
            if i == n:
                self.close()

        return cb


def is_inside(path: Union[str, Path], folder: Union[str, Path]) -> bool:
    """Whether ``path`` is ``folder`` or lies under it (both resolved)."""
    p, f = Path(path).resolve(), Path(folder).resolve()
    return p == f or p.is_relative_to(f)

