"""Backend options: what a backend lets a user choose, declared by the backend itself.

A backend that takes options declares a dataclass of them (each field made with :func:`option`) and names it in its
registry line (``harness.core.backends.REGISTRY``). The harness then gives the user a key per field under the backend's
name (``<backend>.<field>=<value>``), checks the value against the field's choices before anything runs, records the
backend's options in its rows (``backend_options``) and passes an instance to the backend:
``cls.unsupported_reason(case, options)``, ``cls(case, group, options)`` and, where declared,
``cls.direction_unsupported(case, direction, options)``. A backend without options keeps the two-argument forms.

A field may answer to an alias, one top-level key (``<alias>=<value>``) that sets the field of every backend
declaring that alias. How an option enters a point's ``config_hash`` is declared with it too (:class:`OptionSpec`),
so that the points measured before the option existed keep their hashes. This module names no backend: each backend's
options live beside it (docs/configuration.md lists them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

_KEY = "mokbench_option"


@dataclass(frozen=True)
class OptionSpec:
    """One option's declaration.

    ``choices``: the values it takes. ``alias``: the top-level key that sets it too (None: none). ``help``: one line
    for the documentation. ``hash_precision``: the precision at which the option can change a measurement (None: all);
    elsewhere it stays out of the point's hash. ``hash_default``: whether the default value enters the hash (an option
    added after points were measured leaves it out, so those points keep their hashes). ``unhashed``: the value that
    stays out of the hash instead of the default (an option whose default changed after points were measured at the
    old one: the old default keeps their hashes, and the new default enters as any other value did)."""

    choices: tuple[str, ...]
    alias: Optional[str] = None
    help: str = ""
    hash_precision: Optional[str] = None
    hash_default: bool = False
    unhashed: Optional[str] = None


def option(default: str, *, choices: tuple[str, ...], alias: Optional[str] = None, help: str = "",
           hash_precision: Optional[str] = None, hash_default: bool = False, unhashed: Optional[str] = None) -> Any:
    """A dataclass field for a backend option (see :class:`OptionSpec`)."""
    if default not in choices:
        raise ValueError(f"default {default!r} is not one of the choices {choices}")
    if unhashed is not None and (unhashed not in choices or hash_default):
        raise ValueError(f"unhashed={unhashed!r} must be one of the choices {choices}, without hash_default")
    spec = OptionSpec(tuple(choices), alias, help, hash_precision, hash_default, unhashed)
    return dataclasses.field(default=default, metadata={_KEY: spec})


def option_specs(cls: type) -> dict[str, OptionSpec]:
    """Field name -> :class:`OptionSpec` of an options dataclass (a field not made by :func:`option` is an error)."""
    out = {}
    for f in dataclasses.fields(cls):
        if _KEY not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with contract.options.option()")
        out[f.name] = f.metadata[_KEY]
    return out


def options_text(options: Any) -> str:
    """An options instance as a row records it: ``field=value`` pairs in declaration order, ``,``-separated."""
    return ",".join(f"{f.name}={getattr(options, f.name)}" for f in dataclasses.fields(options))
