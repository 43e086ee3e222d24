"""Plain data (YAML, overrides) -> frozen kw-only dataclasses, checked against the annotations.

The fields of a dataclass are its only valid keys: an unknown key is refused with the list of
valid ones, a wrong type names the key, the value, where it came from and the fix. A field whose
metadata holds ``parse`` checks itself (its class's ``__post_init__`` runs the parser), so the
annotation alone need not express everything (e.g. a Slurm time limit given as a number).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Mapping

from ddp_hpc.errors import HintError

__all__ = ["ConfigError", "build", "to_dict", "key_of", "did_you_mean"]


class ConfigError(HintError, ValueError):
    """A configuration value is wrong; the message names the key, the value, its source and the fix."""


def _union_ok(value: Any, tp: Any) -> tuple[bool, Any]:
    for arg in typing.get_args(tp):
        ok, v = type_ok(value, arg)
        if ok:
            return True, v
    return False, value


def _float_ok(value: Any) -> tuple[bool, Any]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return True, float(value)
    if isinstance(value, str):   # PyYAML reads 1e-3 (no dot) as a string: accept it
        try:
            return True, float(value)
        except ValueError:
            pass
    return False, value


def _tuple_ok(value: Any, tp: Any) -> tuple[bool, Any]:
    args = typing.get_args(tp)
    if not isinstance(value, (list, tuple)) or len(value) != len(args):
        return False, value
    out = []
    for v, a in zip(value, args):
        ok, cv = type_ok(v, a)
        if not ok:
            return False, value
        out.append(cv)
    return True, tuple(out)


def type_ok(value: Any, tp: Any) -> tuple[bool, Any]:
    """Check (and gently coerce: int -> float, list -> tuple) a value against an annotation."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _union_ok(value, tp)
    if tp is type(None):
        return value is None, value
    if origin is Literal:
        return value in typing.get_args(tp), value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        return _float_ok(value)
    if tp is str:
        return isinstance(value, str), value
    if tp is dict:
        return isinstance(value, dict), (dict(value) if isinstance(value, dict) else value)
    if origin is tuple:
        return _tuple_ok(value, tp)
    return True, value


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return str(tp).replace("typing.", "") if not isinstance(tp, type) else tp.__name__


def _choices(tp: Any) -> tuple | None:
    """The values a key annotated ``Literal[...]`` (or ``Literal[...] | None``) may take; None for
    any other annotation."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        parts = [_choices(a) if a is not type(None) else (None,) for a in typing.get_args(tp)]
        return None if None in parts else tuple(v for p in parts for v in p)
    return None


def _bad_value(key: str, value: Any, tp: Any, source: str) -> ConfigError:
    """A value that does not fit the key's annotation: one outside a fixed set of values names
    them (and the nearest), any other names the type the key takes."""
    choices = _choices(tp)
    if choices is None:
        return ConfigError(f"config key {key!r} has the wrong type: {value!r} ({type(value).__name__}) "
                           f"from {source}", f"{key} must be {_type_name(tp)}")
    return ConfigError(f"config key {key!r} = {value!r} is not one of its values (from {source})",
                       f"{key} is one of {', '.join(repr(c) for c in choices)}"
                       + did_you_mean(value, choices))


def did_you_mean(word: Any, choices: typing.Iterable[Any]) -> str:
    """`` (did you mean 'batch_size'?)`` when one of ``choices`` is close to ``word`` (as a mistyped
    flag is answered, ``ddp_hpc.text.did_you_mean``), else ""."""
    near = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def key_of(f: dataclasses.Field) -> str:
    """The config key of a field: its name, or ``metadata["key"]`` for a key that is no Python
    name (``checkpoint.async`` is the field ``async_``)."""
    return f.metadata.get("key", f.name)


def _unknown_key(cls: type, unknown: str, where: str, source: str) -> ConfigError:
    key = f"{where}.{unknown}" if where else str(unknown)
    keys = sorted(key_of(f) for f in dataclasses.fields(cls))
    valid = ", ".join(keys)
    extra = getattr(cls, "UNKNOWN_KEY_HINT", "")
    return ConfigError(f"unknown config key {key!r}{did_you_mean(unknown, keys)} ({source})",
                       f"valid keys{' in ' + where if where else ''} are: {valid}"
                       + (f"; {extra}" if extra else ""))


def build(cls: type, raw: Any, where: str, source: str) -> Any:
    """An instance of dataclass ``cls`` from the mapping ``raw`` found at ``where`` in ``source``."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where or 'the config'} must be a mapping of keys, got {raw!r} "
                          f"({source})", "write it as `key: value` lines in the YAML file")
    hints = typing.get_type_hints(cls)
    fields = {key_of(f): f for f in dataclasses.fields(cls)}
    for k in raw:
        if k not in fields:
            raise _unknown_key(cls, k, where, source)
    kwargs = {}
    for name, value in raw.items():
        f = fields[name]
        tp, key = hints[f.name], (f"{where}.{name}" if where else name)
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = build(tp, value, key, source)
            continue
        ok, coerced = (True, value) if "parse" in f.metadata else type_ok(value, tp)
        if not ok:
            raise _bad_value(key, value, tp, source)
        kwargs[f.name] = coerced
    try:
        return cls(**kwargs)
    except ConfigError as e:   # checks in __post_init__: add where the values came from
        raise ConfigError(f"{e.problem} ({source})", e.hint) from None


def to_dict(obj: Any) -> dict:
    """Plain dict/list/str/number form (YAML- and torch.load(weights_only)-safe)."""
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            v = to_dict(v)
        elif isinstance(v, tuple):
            v = list(v)
        elif isinstance(v, dict):
            v = dict(v)
        out[key_of(f)] = v
    return out
