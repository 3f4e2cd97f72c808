"""Method names -> (config dataclass, method class). The one list of what `--method` accepts."""

from __future__ import annotations

import dataclasses
from typing import Any

from trainers.allreduce import AllReduce, AllReduceConfig
from trainers.cocktail import Cocktail, CocktailConfig
from trainers.diloco import DiLoCo, DiLoCoConfig
from trainers.dilocox import DiLoCoX, DiLoCoXConfig
from trainers.local import Local, LocalConfig
from trainers.method import Method, MethodContext

METHODS: dict[str, tuple[type, type[Method]]] = {
    "allreduce": (AllReduceConfig, AllReduce),
    "opendiloco": (DiLoCoConfig, DiLoCo),
    "cocktail": (CocktailConfig, Cocktail),
    "dilocox": (DiLoCoXConfig, DiLoCoX),
    "local": (LocalConfig, Local),
}


def method_names() -> list[str]:
    return list(METHODS)


def method_config(name: str, options: dict[str, Any] | None = None) -> Any:
    """The validated config of method `name`; options that the method does not have are refused by name."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(METHODS)}")
    config_cls, _ = METHODS[name]
    # None means "not set"; the string "none" is how a user turns an optional setting off (e.g. --bits none).
    options = {k: None if v == "none" else v for k, v in (options or {}).items() if v is not None}
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        flags = ", ".join("--" + k.replace("_", "-") for k in unknown)
        raise ValueError(
            f"{flags} does not apply to method {name!r}; its options are: "
            f"{', '.join('--' + f.replace('_', '-') for f in sorted(fields)) or 'none'}"
        )
    return config_cls(**options)


def build_method(name: str, config: Any, ctx: MethodContext) -> Method:
    return METHODS[name][1](ctx, config)
