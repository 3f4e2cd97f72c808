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


# Each value a method's config refuses, with the words its sentence must hold (the setting, what it takes, the value).
BAD_SETTINGS = [
    ("opendiloco", {"local_steps": 0}, "local_steps must be at least 1, got 0"),
    ("opendiloco", {"outer_lr": 0.0}, "outer_lr must be a positive finite number, got 0.0"),
    ("opendiloco", {"outer_lr": float("inf")}, "outer_lr must be a positive finite number, got inf"),
    ("opendiloco", {"outer_momentum": 1.0}, "outer_momentum must be in [0, 1), got 1.0"),
    ("opendiloco", {"pseudo_grad_dtype": "int3"}, "pseudo_grad_dtype takes one of fp16, bf16, fp32, got 'int3'"),
    ("dilocox", {"overlap": "sometimes"}, "overlap takes one of"),
    ("dilocox", {"overlap_steps": -1}, "overlap_steps must be at least 0, got -1"),
    ("dilocox", {"overlap": "streaming", "overlap_steps": 25}, "overlap_steps must be below local_steps (20)"),
    ("dilocox", {"merge_alpha": 1.5}, "merge_alpha must be in [0, 1], got 1.5"),
    ("dilocox", {"rank": 0}, "rank must be at least 1, got 0"),
    ("dilocox", {"bits": 3}, "bits must be one of 2, 4, 8; got 3"),
    ("dilocox", {"bucket_size": 0}, "bucket_size must be at least 1, got 0"),
    ("dilocox", {"power_iterations": 0}, "power_iterations must be at least 1, got 0"),
    ("dilocox", {"rank_window": 0}, "rank_window must be at least 1, got 0"),
    ("dilocox", {"energy": 0.0}, "energy must be in (0, 1], got 0.0"),
    ("dilocox", {"min_rank": 100}, "min_rank must be between 1 and rank (64), got 100"),
    ("dilocox", {"max_local_steps": 5}, "max_local_steps must be at least local_steps (20), got 5"),
    ("dilocox", {"exchange": "reduce", "compression": False}, "which compression=false turns off"),
    ("dilocox", {"exchange": "reduce", "overlap": "eager"}, "overlap=eager restarts from the replica's own"),
    ("sparseloco", {"error_decay": 1.5}, "error_decay must be in [0, 1], got 1.5"),
    ("sparseloco", {"density": 0.0}, "density must be in (0, 1], got 0.0"),
    ("sparseloco", {"chunk_size": 0}, "chunk_size must be at least 1, got 0"),
    ("sparseloco", {"bits": 9}, "bits must be an integer from 1 to 8, got 9"),
    ("sparseloco", {"quantization_range": -1.0}, "quantization_range must be a positive finite number, got -1.0"),
    ("demo", {"compression_decay": 1.0}, "compression_decay must be in [0, 1), got 1.0"),
    ("demo", {"compression_topk": 0}, "compression_topk must be an integer of at least 1, got 0"),
    ("demo", {"compression_chunk": 0}, "compression_chunk must be an integer of at least 1, got 0"),
    ("demo", {"demo_lr": 0.0}, "demo_lr must be a positive finite number, got 0.0"),
    ("demo", {"demo_weight_decay": -1.0}, "demo_weight_decay must be a finite number of at least 0, got -1.0"),
    ("demo", {"demo_lr": 0.5, "demo_weight_decay": 4.0}, "demo_weight_decay times demo_lr must be below 1"),
    ("cocktail", {"random_keep": 0.0}, "random_keep must be in (0, 1], got 0.0"),
    ("cocktail", {"topk_keep": 2.0}, "topk_keep must be in (0, 1], got 2.0"),
    ("cocktail", {"bits": 3}, "bits must be one of 2, 4, 8 or none (fp32 values); got 3"),
    ("cocktail", {"warmup_steps": -1}, "warmup_steps must be at least 0, got -1"),
]


@pytest.mark.parametrize(("method", "options", "words"), BAD_SETTINGS, ids=lambda v: str(v))
def test_each_value_a_method_refuses_is_one_sentence_naming_the_setting(method, options, words):
    with pytest.raises(ValueError) as err:
        method_config(method, options)
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)
