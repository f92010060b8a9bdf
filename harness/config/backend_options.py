"""The backends' options in the configuration (each backend declares its own: :mod:`contract.options`).

Every backend whose registry line names an options dataclass gets a node of its own in the configuration, under its
key: ``nccl.fp8_gemm=rowwise``, ``mok_hopper.forward=recompute``. An option with an alias also answers to that
top-level key, which sets it for every backend declaring the alias (``fp8_gemm=rowwise``); :func:`apply_aliases`
turns a given alias into the scoped values once, before anything else reads them. This module builds those schema
fields, the options a backend gets, and the entries that the options add to a point's
``config_hash``. Its functions read a configuration typed (:func:`harness.config.point.resolve`) or as plain values
(a row's stored ``point_config``, which the hash reads).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
from collections.abc import Mapping
from typing import Any, Optional

from contract.options import OptionSpec, option_specs
from harness.core.backends import REGISTRY

HASH_KEY = "backend_options"  # where a point's hash puts the options that no alias names (see hash_entries)


@functools.cache
def options_class(backend: str) -> Optional[type]:
    """The options dataclass a backend declares (None: it takes none)."""
    target = REGISTRY[backend].options if backend in REGISTRY else ""
    if not target:
        return None
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def option_backends() -> dict[str, type]:
    """Backend key -> its options dataclass, for every backend that declares one (registry order)."""
    return {k: cls for k in REGISTRY if (cls := options_class(k)) is not None}


def aliases() -> dict[str, list[tuple[str, str, OptionSpec]]]:
    """Alias -> the options it sets: (backend, field, spec), in registry order."""
    out: dict[str, list[tuple[str, str, OptionSpec]]] = {}
    for backend, cls in option_backends().items():
        for name, spec in option_specs(cls).items():
            if spec.alias:
                out.setdefault(spec.alias, []).append((backend, name, spec))
    return out


def schema_fields() -> list[tuple[str, Any, Any]]:
    """The configuration's fields for the options (``dataclasses.make_dataclass`` form): one node per backend that
    declares options, and one ``Optional[str]`` per alias (None: not given)."""
    fields: list[tuple[str, Any, Any]] = [(k, cls, dataclasses.field(default_factory=cls))
                                          for k, cls in option_backends().items()]
    fields += [(a, Optional[str], dataclasses.field(default=None)) for a in aliases()]
    return fields


def config_keys() -> tuple[str, ...]:
    """The top-level configuration keys the options take (the backends' nodes and the aliases)."""
    return (*option_backends(), *aliases())


def config_value(node: Any, key: str, default: Any = None) -> Any:
    """``node``'s ``key``: an item of plain values (a mapping: a dict, a DictConfig), else an attribute of the typed
    configuration."""
    return node.get(key, default) if isinstance(node, Mapping) else getattr(node, key, default)


def _set(node: Any, key: str, value: Any) -> None:
    """Set ``node``'s ``key`` (:func:`config_value`'s two kinds of node)."""
    if isinstance(node, Mapping):
        node[key] = value
    else:
        setattr(node, key, value)


def alias_conflicts(c: Any) -> list[str]:
    """The aliases given in ``c`` beside a scoped value that differs from both its default and the alias (one of the
    two would be dropped without a word): a message for each."""
    out = []
    for alias, targets in aliases().items():
        value = config_value(c, alias)
        if value is None:
            continue
        for backend, name, _ in targets:
            got = _value(c, backend, name)
            if got not in (_default(backend, name), value):
                out.append(f"{alias}={value} conflicts with {backend}.{name}={got}: give one of the two ({alias} sets "
                           f"{', '.join(f'{b}.{n}' for b, n, _ in targets)})")
    return out


def apply_aliases(c: Any) -> None:
    """Put each alias given in ``c`` (a resolved configuration, checked: harness.config.validate; typed, or plain
    values) into the options it names, and clear the alias, so that nothing after reads an alias."""
    for alias, targets in aliases().items():
        value = config_value(c, alias)
        if value is None:
            continue
        for backend, name, _ in targets:
            if config_value(c, backend) is None:  # (plain values may lack a backend's options)
                _set(c, backend, {})
            _set(config_value(c, backend), name, value)
        _set(c, alias, None)


def option_values(c: Any) -> list[tuple[str, Any, OptionSpec]]:
    """Every option value of ``c`` to check: (the key as the user writes it, value, spec), the aliases given first."""
    out = [(alias, config_value(c, alias), targets[0][2]) for alias, targets in aliases().items()
           if config_value(c, alias) is not None]
    for backend, cls in option_backends().items():
        for name, spec in option_specs(cls).items():
            out.append((f"{backend}.{name}", _value(c, backend, name), spec))
    return out


def _unhashed(spec: OptionSpec, backend: str, name: str) -> Any:
    """The value of an option that stays out of the hash (without ``hash_default``): its ``unhashed``, else its
    default."""
    return _default(backend, name) if spec.unhashed is None else spec.unhashed


def _default(backend: str, name: str) -> Any:
    return {f.name: f.default for f in dataclasses.fields(options_class(backend))}[name]


def _value(c: Any, backend: str, name: str) -> Any:
    """The value of ``backend``'s option ``name`` in ``c`` (its default where ``c`` gives none)."""
    return config_value(config_value(c, backend) or {}, name, _default(backend, name))


def _hash_value(c: Any, backend: str, name: str) -> Any:
    """The value a point's hash reads: as :func:`_value`, but an option missing from ``c`` (a configuration stored
    before the option existed) held the value that stays out of the hash (:func:`_unhashed`)."""
    node = config_value(c, backend)
    if node is not None and (not isinstance(node, Mapping) or name in node):
        return config_value(node, name)
    return _unhashed(option_specs(options_class(backend))[name], backend, name)


def _applied(c: Any) -> Any:
    """``c`` with its aliases put into the options they name (a copy where any is given)."""
    if all(config_value(c, a) is None for a in aliases()):
        return c
    if isinstance(c, Mapping):
        c = {**c, **{b: dict(c.get(b) or {}) for b in option_backends()}}
    else:
        c = copy.deepcopy(c)
    apply_aliases(c)
    return c


def options_for(backend: str, c: Any) -> Any:
    """The options instance ``backend`` gets from the configuration ``c`` (None: it declares none)."""
    cls = options_class(backend)
    if cls is None:
        return None
    node = config_value(_applied(c), backend) or {}
    return cls(**{f.name: config_value(node, f.name) for f in dataclasses.fields(cls)
                  if (f.name in node if isinstance(node, Mapping) else hasattr(node, f.name))})


def hash_entries(c: Any, precision: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """What the options add to a point's hash: (entries under their alias names, which go beside the case's fields,
    where the fields of that name used to be; the others, backend -> field -> value, under :data:`HASH_KEY`).

    An option enters only where it can change a measurement (its ``hash_precision``) and, unless its spec says
    ``hash_default``, only when it is not its default. An aliased option whose backends all hold one value enters once
    under its alias; backends that differ enter one by one, as options without an alias do. So a point measured before
    an option moved into its backend (or existed) keeps its hash."""
    c = _applied(c)
    by_alias: dict[str, Any] = {}
    scoped: dict[str, dict[str, Any]] = {}
    for alias, targets in aliases().items():
        # where the alias's backends hash their defaults, one that does not (it joined the alias after points were
        # measured) does not make the others' values differ while it is at its default
        joined_later = any(s.hash_default for _, _, s in targets)
        values = {_hash_value(c, b, n) for b, n, s in targets
                  if not (joined_later and not s.hash_default and _hash_value(c, b, n) == _unhashed(s, b, n))}
        spec = targets[0][2]
        if len(values) == 1:
            value = values.pop()
            if _hashed(spec, value, _default(targets[0][0], targets[0][1]), precision):
                by_alias[alias] = value
            continue
        for b, n, s in targets:
            value = _hash_value(c, b, n)
            if _hashed(s, value, _default(b, n), precision):
                scoped.setdefault(b, {})[n] = value
    for backend, cls in option_backends().items():
        for name, spec in option_specs(cls).items():
            value = _hash_value(c, backend, name)
            if not spec.alias and _hashed(spec, value, _default(backend, name), precision):
                scoped.setdefault(backend, {})[name] = value
    return by_alias, scoped


def _hashed(spec: OptionSpec, value: Any, default: Any, precision: str) -> bool:
    if spec.hash_precision is not None and precision != spec.hash_precision:
        return False
    return spec.hash_default or value != (default if spec.unhashed is None else spec.unhashed)
