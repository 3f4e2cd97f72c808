"""Method names -> their classes. The one list of what `--method` accepts.

Adding a method takes two files: `trainers/methods/<name>.py`, holding its config dataclass and its `Method` subclass
(whose `config_class` names the config), and one line here. Its settings (`--set`, `harness methods`, sweeps and
baselines) are the config's fields, each documented where it is declared (`metadata["help"]`). Modules are
imported on first use, so listing the names costs nothing (no torch).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import types
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from trainers.config import format_value

if TYPE_CHECKING:
    from trainers.method import Method, MethodContext

METHODS: dict[str, str] = {
    "allreduce": "trainers.methods.allreduce:AllReduce",
    "opendiloco": "trainers.methods.opendiloco:OpenDiLoCo",
    "cocktail": "trainers.methods.cocktail:Cocktail",
    "dilocox": "trainers.methods.dilocox:DiLoCoX",
    "sparseloco": "trainers.methods.sparseloco:SparseLoCo",
    "local": "trainers.methods.local:Local",
    "demo": "trainers.methods.demo:DeMo",
}


def method_names() -> list[str]:
    return list(METHODS)


def method_class(name: str) -> type[Method]:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(METHODS)}")
    module, _, cls = METHODS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def option_names(name: str) -> frozenset[str]:
    """The settings method `name` takes (its config's fields)."""
    return frozenset(f.name for f in dataclasses.fields(method_class(name).config_class))


class MethodOption(NamedTuple):
    """A method config field by name, reconciled across the methods that have it."""

    kind: Any  # the field's type; Optional where one of the methods also accepts None
    defaults: dict[str, Any]  # method -> its default
    help: str  # the field's `metadata["help"]` in the first method that gives one, else ""

    @property
    def accepts_none(self) -> bool:
        return _optional(self.kind)


def method_options() -> dict[str, MethodOption]:
    """Every method config field, once, by name: what sweeps' keys and the refusal of an old flag are made from.

    A field that several methods share must have one type, except that one method may also accept None
    (e.g. cocktail's bits=none): the setting then accepts 'none' and the method that refuses it says so.
    """
    options: dict[str, MethodOption] = {}
    for name in method_names():
        config_cls = method_class(name).config_class
        hints = typing.get_type_hints(config_cls)
        for f in dataclasses.fields(config_cls):
            kind, known = hints[f.name], options.get(f.name)
            if known is None:
                known = MethodOption(kind, {}, "")
            elif _strip_none(kind) != _strip_none(known.kind):
                raise TypeError(f"method option {f.name} has type {known.kind} in one method and {kind} in {name}")
            elif _optional(kind):
                known = known._replace(kind=kind)
            if not known.help and f.metadata.get("help"):
                known = known._replace(help=f.metadata["help"])
            known.defaults[name] = f.default
            options[f.name] = known
    return options


def _optional(kind: Any) -> bool:
    return typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in typing.get_args(kind)


def _strip_none(kind: Any) -> Any:
    if not _optional(kind):
        return kind
    (inner,) = [k for k in typing.get_args(kind) if k is not type(None)]
    return inner


def method_config(name: str, options: dict[str, Any] | None = None) -> Any:
    """The validated config of method `name`; options that the method does not have, or of the wrong type, are
    refused by name. Values may come as --set reads them (the string "none" switches an optional setting off; an
    int where a float is due is that float); None means "not set"."""
    config_cls = method_class(name).config_class
    hints = typing.get_type_hints(config_cls)
    options = {k: v for k, v in (options or {}).items() if v is not None}
    unknown = sorted(set(options) - set(hints))
    if unknown:
        raise ValueError(
            f"{', '.join(unknown)} {'is not a setting' if len(unknown) == 1 else 'are not settings'} of {name}; "
            f"its settings are: {', '.join(f.name for f in dataclasses.fields(config_cls)) or 'none'}"
        )
    return config_cls(**{key: _checked(name, key, hints[key], value) for key, value in options.items()})


def with_later_settings(name: str, recorded: dict[str, Any]) -> dict[str, Any]:
    """A run's recorded options with every setting added to the method after the run was made, at the value that
    run ran with (a field's `before_it_existed` metadata): a long-lived reference run stays comparable."""
    if name not in METHODS:
        return recorded
    added = {
        spec.name: spec.metadata["before_it_existed"]
        for spec in dataclasses.fields(method_class(name).config_class)
        if "before_it_existed" in spec.metadata and spec.name not in recorded
    }
    return {**recorded, **added}


def check_applicable(name: str, config: Any, given: dict[str, Any]) -> None:
    """Refuses a setting given where the rest of the config makes the method ignore it (a field's
    `applies_when` metadata: the values other settings must have): it would change nothing and still label the run."""
    for spec in dataclasses.fields(config):
        if given.get(spec.name) is None:
            continue
        for other, allowed in spec.metadata.get("applies_when", {}).items():
            actual = getattr(config, other)
            if actual not in allowed:
                wanted = " or ".join(f"{other}={format_value(value)}" for value in allowed)
                raise ValueError(
                    f"{name}'s setting {spec.name} applies only with {wanted}, and this run has "
                    f"{other}={format_value(actual)}; leave {spec.name} out or set {wanted}"
                )


def applicable_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """`options` less those the others make the method ignore (a field's `applies_when`): a run's recorded options,
    every field included, given back as settings would otherwise be refused by check_applicable, and what they leave
    out changes nothing."""
    if name not in METHODS:
        return options
    fields = {spec.name: spec for spec in dataclasses.fields(method_class(name).config_class)}
    return {
        key: value
        for key, value in options.items()
        if key not in fields
        or all(options.get(other) in allowed for other, allowed in fields[key].metadata.get("applies_when", {}).items())
    }


def _checked(method: str, key: str, kind: Any, value: Any) -> Any:
    """`value` as field `key` of type `kind` holds it, or a ValueError naming the setting and what it takes."""
    optional = _optional(kind)
    if isinstance(value, str) and value.lower() == "none" and optional:
        return None
    kind = _strip_none(kind)
    if typing.get_origin(kind) is typing.Literal:
        choices = typing.get_args(kind)
        # Not a string: a run recorded before the setting became a choice (dilocox's overlap was a switch), which
        # the config's own check reads or refuses.
        if not isinstance(value, str) or value in choices:
            return value
        wanted = f"one of {', '.join(choices)}"
    elif kind is bool:
        if isinstance(value, bool):
            return value
        wanted = "true or false"
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        wanted = "a whole number" + (" or none" if optional else "")
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        wanted = "a number"
    else:
        return value
    raise ValueError(f"{method}'s setting {key} takes {wanted}, got {value!r}")


def recorded_options(config: Any) -> dict[str, Any]:
    """Every field of a method's config, defaults and what they derive included, as JSON holds them: what a run
    records as its method_options. Two runs ran the same variant of a method iff these are equal, whatever defaults
    the code that made them had."""
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


def resolved_options(name: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """recorded_options of method `name` given `options` over this checkout's defaults; raises as method_config."""
    return recorded_options(method_config(name, dict(options or {})))


def options_shown(name: str, resolved: Mapping[str, Any]) -> dict[str, Any]:
    """The fewest options, in field order, that give `resolved` over method `name`'s current defaults: what a
    variant's label names. A derived value is left out where its source sets it (dilocox's overlap_steps follows
    local_steps), so `dilocox (local_steps=20)` is all that --local-steps 20 shows; a recorded option today's config
    lacks is shown too."""
    fields = [f.name for f in dataclasses.fields(method_class(name).config_class)]
    shown: dict[str, Any] = {}
    for key in fields:
        if key not in resolved:
            continue
        try:
            # "none" is how a given option says None (method_config reads None as "not set").
            current = resolved_options(name, {k: "none" if v is None else v for k, v in shown.items()}).get(key)
        except (ValueError, TypeError):
            current = object()  # the options so far are refused on their own: name this one too
        if current != resolved[key]:
            shown[key] = resolved[key]
    return {**shown, **{k: v for k, v in resolved.items() if k not in fields}}


def build_method(name: str, config: Any, ctx: MethodContext) -> Method:
    return method_class(name)(ctx, config)
