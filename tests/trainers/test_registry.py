"""The method registry: every setting that the rest of a config makes a method ignore is refused when given."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from trainers.registry import check_applicable, method_class, method_config, method_names


def _choices(config_cls: type, name: str) -> tuple:
    """Every value a setting can take that decides whether another applies: a choice's options or true/false."""
    kind = typing.get_type_hints(config_cls)[name]
    return (True, False) if kind is bool else typing.get_args(kind)


CONDITIONAL = [
    (method, spec.name, other, value, value in allowed)
    for method in method_names()
    for spec in dataclasses.fields(method_class(method).config_class)
    for other, allowed in spec.metadata.get("applies_when", {}).items()
    for value in _choices(method_class(method).config_class, other)
]


def test_dilocoxs_settings_that_only_some_designs_read_are_declared_so():
    declared = {(m, name, other) for m, name, other, _, _ in CONDITIONAL}
    for setting, other in [
        ("reduce_wire", "exchange"),
        ("bits", "exchange"),
        ("bits", "compression"),
        ("power_iterations", "exchange"),
        ("overlap_steps", "overlap"),
        ("merge_alpha", "overlap"),
        ("min_rank", "adaptive"),
        ("max_local_steps", "adaptive"),
    ]:
        assert ("dilocox", setting, other) in declared


@pytest.mark.parametrize("method, setting, other, value, applies", CONDITIONAL, ids=lambda v: str(v))
def test_a_setting_given_where_it_does_not_apply_is_refused_naming_what_it_needs(
    method, setting, other, value, applies
):
    # The other conditions of the setting are met, so only `other` decides.
    conditions = method_class(method).config_class.__dataclass_fields__[setting].metadata["applies_when"]
    base = {key: allowed[0] for key, allowed in conditions.items() if key != other}
    default = getattr(method_config(method, {}), setting)
    config = None
    # A setting off by default (None) is given the first of a few values its config accepts.
    for candidate in [default] if default is not None else [1, 10, 100, 1000]:
        given = {**base, other: value, setting: candidate}
        try:
            config = method_config(method, given)
            break
        except ValueError:
            continue
    assert config is not None, f"no value of {setting} builds with {other}={value} and {base}"
    if applies:
        check_applicable(method, config, given)
    else:
        with pytest.raises(
            ValueError, match=rf"{method}'s setting {setting} applies only with {other}=.*leave {setting} out"
        ):
            check_applicable(method, config, given)
    # Not given, it is never refused: a default that does not apply changes nothing and labels nothing.
    check_applicable(method, config, {k: v for k, v in given.items() if k != setting})


def test_settings_without_a_condition_are_never_refused_by_it():
    for method in method_names():
        config = method_config(method, {})
        every = {spec.name: getattr(config, spec.name) for spec in dataclasses.fields(config)}
        unconditional = {
            k: v for k, v in every.items() if "applies_when" not in config.__dataclass_fields__[k].metadata
        }
        check_applicable(method, config, unconditional)
