"""Method names -> their classes. The one list of what `--method` accepts.

Adding a method to the project takes two files: `trainers/methods/<name>.py`, holding its config dataclass and its
`Method` subclass (whose `config_class` names the config), and one line in BUILT_IN here. Its settings (`--set`,
`harness methods`, sweeps and baselines) are the config's fields, each documented where it is declared
(`metadata["help"]`). Modules are imported on first use, so listing the names costs nothing (no torch).

A method from outside the repository is the same class in a file of its own: `--method path/to/file.py:Class`
registers it under its `name` (docs/writing-a-method.md), and an installed package lists its methods under the
`harness.methods` entry point group (name = "module:Class"). A run records where its method came from
(`method_source` in config.json), so its ranks, `--config` and `harness reproduce` find it again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import re
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from trainers.config import format_value

if TYPE_CHECKING:
    from trainers.method import Method, MethodContext

ENTRY_POINT_GROUP = "harness.methods"
# A plugin's name is a run id's part and a --set prefix: what a built-in's looks like.
PLUGIN_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")

BUILT_IN: dict[str, str] = {
    "allreduce": "trainers.methods.allreduce:AllReduce",
    "opendiloco": "trainers.methods.opendiloco:OpenDiLoCo",
    "cocktail": "trainers.methods.cocktail:Cocktail",
    "dilocox": "trainers.methods.dilocox:DiLoCoX",
    "sparseloco": "trainers.methods.sparseloco:SparseLoCo",
    "local": "trainers.methods.local:Local",
    "demo": "trainers.methods.demo:DeMo",
}


class PluginError(ValueError):
    """A method from outside the repository that cannot be used; the message names its file and the fix."""


def _installed() -> dict[str, str]:
    """The methods installed packages declare (ENTRY_POINT_GROUP); one that takes a built-in's name is refused."""
    found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    clash = sorted(set(found) & set(BUILT_IN))
    if clash:
        raise PluginError(
            f"an installed package declares a {ENTRY_POINT_GROUP} entry point named {clash[0]!r}, a built-in "
            "method's name; rename its entry point"
        )
    return found


# Every name --method accepts, to its source: "module:Class", or "/abs/file.py:Class" for a file registered by
# register_file (this process only; a run's config.json records it for its ranks). Read it through method_names():
# the installed packages' methods join it on first use (reading the packages' metadata costs ~35 ms at start-up).
METHODS: dict[str, str] = dict(BUILT_IN)


@functools.cache
def _with_installed() -> None:
    for name, source in _installed().items():
        METHODS.setdefault(name, source)


def method_names() -> list[str]:
    _with_installed()
    return list(METHODS)


def is_method(name: str) -> bool:
    return name in method_names()


def method_source(name: str) -> str:
    """Where a method not built in comes from ("" for a built-in): what config.json records as method_source."""
    _with_installed()
    return "" if name in BUILT_IN else METHODS.get(name, "")


def method_class(name: str) -> type[Method]:
    if not is_method(name):
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(METHODS)}")
    where, _, cls = METHODS[name].rpartition(":")
    if where.endswith(".py"):
        return _file_class(where, cls)
    try:
        return getattr(importlib.import_module(where), cls)
    except (ImportError, AttributeError) as err:
        raise PluginError(f"method {name!r} ({METHODS[name]}) cannot be loaded: {err}; reinstall its package") from None


def is_file_spec(text: str) -> bool:
    """`text` names a method in a file (path/to/file.py:Class), not a registered name."""
    path, colon, cls = text.rpartition(":")
    return bool(colon) and cls.isidentifier() and path.endswith(".py")


def register_file(spec: str, expected_name: str | None = None) -> str:
    """Load the Method subclass `spec` names (path/to/file.py:Class), check it as a method, register it, and return
    its name: the class's `name`, else the class's own name in lower case. Raises PluginError naming the file.
    `expected_name`: the name a run recorded for it (a renamed class no longer reruns that run)."""
    path_text, _, cls_name = spec.rpartition(":")
    # Normalized (os.path.abspath drops "x/.."), so one file named two ways registers as one source.
    path = Path(os.path.abspath(Path(path_text).expanduser()))
    if not path.is_file():
        raise PluginError(f"method file {path_text} does not exist; pass path/to/file.py:ClassName")
    cls = _file_class(str(path), cls_name)
    name = cls.__dict__.get("name") or cls_name.lower()
    if not isinstance(name, str) or not PLUGIN_NAME.fullmatch(name):
        raise PluginError(
            f"{path}: {cls_name}'s method name {name!r} must be 1-32 lower-case letters, digits or _ starting with a "
            "letter (it names runs and --set prefixes); set its class attribute name"
        )
    if expected_name is not None and name != expected_name:
        raise PluginError(
            f"{path}: {cls_name} is now named {name!r}, not {expected_name!r} as when the run was made; restore its "
            "name attribute"
        )
    source = f"{path}:{cls_name}"
    _with_installed()
    if METHODS.get(name, source) != source:
        taken = "a built-in method's" if name in BUILT_IN else f"that of {METHODS[name]}"
        raise PluginError(f"{path}: {cls_name}'s name {name!r} is {taken}; give the class another name attribute")
    METHODS[name] = source
    return name


@functools.cache
def _file_class(path: str, cls_name: str) -> type[Method]:
    """The Method subclass `cls_name` of the Python file at `path`, imported once (as a module of its own name, so
    its classes pickle and print as themselves) and checked as a method: PluginError otherwise."""
    from trainers.method import Method, MethodConfig

    module_name = "harness_method_" + hashlib.sha256(path.encode()).hexdigest()[:12]
    module = sys.modules.get(module_name)
    if module is None:
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise PluginError(f"{path} cannot be imported as Python; pass a .py file")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as err:
            del sys.modules[module_name]
            raise PluginError(f"{path} failed to import: {type(err).__name__}: {err}; fix the file") from None
    cls = getattr(module, cls_name, None)
    if cls is None:
        defined = sorted(n for n, v in vars(module).items() if isinstance(v, type) and v.__module__ == module_name)
        raise PluginError(f"{path} has no class {cls_name}; it defines: {', '.join(defined) or 'no classes'}")
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise PluginError(f"{path}: {cls_name} is not a subclass of trainers.method.Method; subclass it")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise PluginError(f"{path}: {cls_name} does not implement {missing}; define it")
    config_cls = getattr(cls, "config_class", None)
    if not (
        dataclasses.is_dataclass(config_cls) and isinstance(config_cls, type) and issubclass(config_cls, MethodConfig)
    ):
        raise PluginError(
            f"{path}: {cls_name}.config_class must be a dataclass subclassing trainers.method.MethodConfig; "
            "declare one (it may have no fields)"
        )
    required = [f.name for f in dataclasses.fields(config_cls) if _no_default(f)]
    if required:
        raise PluginError(
            f"{path}: {config_cls.__name__}'s field {required[0]} has no default; every setting needs one "
            "(the run's defaults are the config's)"
        )
    return cls


def _no_default(spec: dataclasses.Field) -> bool:
    return spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING


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
                message = f"method option {f.name} has type {known.kind} in one method and {kind} in {name}"
                if name not in BUILT_IN:
                    raise PluginError(f"{METHODS[name]}: {message}; give the field another name or the same type")
                raise TypeError(message)
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
    if not is_method(name):
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
    if not is_method(name):
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
