"""Command-line overrides of nested frozen dataclass configs.

    cfg = apply_overrides(cfg, ["spade.rounds=5", "model.dtype=bfloat16", "spade.skills=two_skill"])

A key is a dotted path of dataclass fields; the value is parsed as a Python literal
(numbers, booleans, None, tuples, lists, dicts, quoted strings) and otherwise taken as a
plain string. The new value must fit the field's current type, so a typo fails loudly
and names the field instead of silently training with a wrong setting.

A config class may declare ``OVERRIDE_RESETS = {"field": ("dependent", ...)}``: changing
``field`` resets each dependent field to its default, e.g. ``train.agent.policy_loss=gspo``
drops the previous rule's ``loss`` config (its fields mean nothing to the new rule). A later
override of a dependent field applies on top.

Overrides apply in order, each checked by the configs' own validation (``__post_init__``).
One that is only valid together with a later one (``toy.chain_max_level=12`` needs twelve
``toy.designer_level_weights``, which need the new top level) is applied unchecked, and
the whole config is checked again after the last override: it must be valid by then, or
the error names the overrides that were waiting on it.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import enum
from collections.abc import Sequence
from typing import Any


class OverrideError(ValueError):
    """An override that names no field or gives a value of the wrong type."""


def parse_value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _coerce(path: str, current: Any, value: Any, annotation: Any = None) -> Any:
    if current is None or value is None:
        return value
    # A union field (e.g. ``remat: bool | str``) takes a value of any of its member types.
    union = [t.strip() for t in annotation.split("|")] if isinstance(annotation, str) else []
    if len(union) > 1 and type(value).__name__ in union:
        return value
    if isinstance(current, bool):
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise OverrideError(f"{path} expects true/false (True/False), got {value!r}")
        return value
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(current, tuple) and isinstance(value, list | tuple):
        return tuple(value)
    if isinstance(current, str) and not isinstance(value, str):
        return str(value)
    if isinstance(current, enum.Enum):  # a mode field: one of its enum's values
        try:
            return type(current)(value)
        except ValueError:
            raise OverrideError(f"{path} must be one of {[m.value for m in type(current)]}, "
                                f"got {value!r}") from None
    if dataclasses.is_dataclass(current):
        raise OverrideError(f"{path} is a section; override one of its fields: "
                            f"{[f.name for f in dataclasses.fields(current)]}")
    if not isinstance(value, type(current)):
        raise OverrideError(
            f"{path} expects {type(current).__name__} (current {current!r}), got {value!r}")
    return value


def _replace(config: Any, validate: bool, **changes: Any) -> Any:
    """``dataclasses.replace``, or (``validate=False``) a copy with ``changes`` set and no
    ``__post_init__`` run: ``apply_overrides`` checks the result later."""
    if validate:
        return dataclasses.replace(config, **changes)
    out = copy.copy(config)
    for name, value in changes.items():
        object.__setattr__(out, name, value)
    return out


def set_path(config: Any, path: str, value: Any, validate: bool = True) -> Any:
    """Returns a copy of ``config`` with the dotted ``path`` set to ``value`` (unchecked by
    the sections' ``__post_init__`` with ``validate=False``)."""
    head, _, rest = path.partition(".")
    if not dataclasses.is_dataclass(config):
        raise OverrideError(f"cannot descend into {head!r}: not a config section")
    fields = {f.name: f for f in dataclasses.fields(config)}
    names = set(fields)
    if head not in names:
        raise OverrideError(f"unknown config field {head!r} in {type(config).__name__}; "
                            f"known: {sorted(names)}")
    current = getattr(config, head)
    if rest:
        if current is None:
            raise OverrideError(f"{head} is None; set the whole section in the experiment file")
        new = set_path(current, rest, value, validate)
    else:
        new = _coerce(path, current, value, fields[head].type)
        if new != current:
            return _replace(config, validate, **{head: new, **_reset_dependents(config, head)})
    return _replace(config, validate, **{head: new})


def _reset_dependents(config: Any, name: str) -> dict[str, Any]:
    """Defaults of the fields ``type(config).OVERRIDE_RESETS`` ties to field ``name``."""
    dependents = getattr(type(config), "OVERRIDE_RESETS", {}).get(name, ())
    fields = {f.name: f for f in dataclasses.fields(config)}
    out = {}
    for dependent in dependents:
        field = fields[dependent]
        if field.default is not dataclasses.MISSING:
            out[dependent] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            out[dependent] = field.default_factory()
        else:
            raise TypeError(f"{type(config).__name__}.{dependent} has no default to reset to")
    return out


def apply_overrides(config: Any, overrides: Sequence[str]) -> Any:
    """Applies ``key=value`` strings in order; raises OverrideError naming the bad one. An
    override the configs' validation rejects is kept unchecked until the last one has
    applied (module docstring), then the whole config must validate."""
    waiting: list[tuple[str, str]] = []  # (override, the validation error it met)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise OverrideError(f"override {item!r} is not of the form section.field=value")
        value = parse_value(raw.strip())
        try:
            config = set_path(config, key.strip(), value)
        except OverrideError as e:
            raise OverrideError(f"override {item!r}: {e}") from None
        except (TypeError, ValueError) as e:  # a config's own validation in __post_init__
            waiting.append((item, str(e)))
            config = set_path(config, key.strip(), value, validate=False)
    if waiting:
        try:
            config = revalidate(config)
        except (TypeError, ValueError) as e:
            own = [item for item, error in waiting if error == str(e)]
            if own:  # the config still fails as this override did when it was applied
                raise OverrideError(f"override {own[-1]!r} is invalid: {e}") from None
            names = ", ".join(repr(item) for item, _ in waiting)
            raise OverrideError(f"after every override the config is invalid: {e} (overrides "
                                f"that did not validate when applied: {names})") from None
    return config


def revalidate(config: Any) -> Any:
    """``config`` rebuilt from the leaves up, so every section's ``__post_init__`` runs on
    its final fields (the check ``apply_overrides`` deferred)."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return config
    changes = {f.name: revalidate(getattr(config, f.name)) for f in dataclasses.fields(config)
               if f.init and dataclasses.is_dataclass(getattr(config, f.name))}
    return dataclasses.replace(config, **changes)


def diff(a: Any, b: Any, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """Leaf fields that differ between two configs of the same structure."""
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b) and type(a) is type(b):
        out: dict[str, tuple[Any, Any]] = {}
        for f in dataclasses.fields(a):
            out.update(diff(getattr(a, f.name), getattr(b, f.name), f"{prefix}{f.name}."))
        return out
    return {} if a == b else {prefix.rstrip("."): (a, b)}
