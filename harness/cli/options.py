"""Flags that several commands take, each declared once; the defaults they show come from the config dataclasses
(trainers/config.py, harness/run/config.py), and the method options from the methods' own configs."""

from __future__ import annotations

import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from harness.backends import BACKENDS
from harness.run.config import LINK_EMULATORS, RunConfig
from trainers.config import OptimConfig, TrainConfig
from trainers.registry import MethodOption, method_names, method_options

DEFAULT_PROFILE = "1gbps"

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def _apply(flags: list[Decorator], command):
    for flag in reversed(flags):
        command = flag(command)
    return command


def profile_option(command):
    return click.option(
        "--profile", default=DEFAULT_PROFILE, show_default=True, help="Profile name or path to a profile YAML."
    )(command)


def method_option(default: str) -> Decorator:
    return click.option("--method", default=default, show_default=True, help=f"One of: {', '.join(method_names())}.")


def _shape_option(flag: str, help_text: str, default: int | None, config_default: int) -> Decorator:
    """`default=None` (sweeps): unset keeps RunConfig's default, which the help then names."""
    if default is None:
        help_text += f" [default: {config_default}]"
    return click.option(flag, type=int, default=default, show_default=default is not None, help=help_text + ".")


def clusters_option(default: int | None = RunConfig.clusters) -> Decorator:
    return _shape_option("--clusters", "Sites joined by the shaped link", default, RunConfig.clusters)


def stages_option(default: int | None = RunConfig.stages) -> Decorator:
    return _shape_option("--stages", "Pipeline stages (ranks) per cluster", default, RunConfig.stages)


def _choice_option(flag: str, choices: tuple[str, ...], default: str | None, fallback: str, text: str) -> Decorator:
    """A choice whose default shows in the help; None leaves it unset (a sweep's runs keep RunConfig's default),
    and the help says what that default is."""
    return click.option(
        flag,
        default=default,
        show_default=default is not None,
        type=click.Choice(choices),
        help=" ".join(part for part in (text, None if default is not None else f"[default: {fallback}]") if part)
        or None,
    )


def backend_option(default: str | None = RunConfig.backend) -> Decorator:
    return _choice_option("--backend", BACKENDS, default, RunConfig.backend, "")


def link_emulator_option(default: str | None = RunConfig.link_emulator) -> Decorator:
    return _choice_option(
        "--link-emulator",
        LINK_EMULATORS,
        default,
        RunConfig.link_emulator,
        "What adds a profile's delay, jitter and loss: netem, or the userspace delay line where the kernel "
        "has no sch_netem (auto picks; `harness doctor` says which this machine has).",
    )


def paths_option(flag: str, dest: str, help: str, **path: bool) -> Decorator:
    """A repeatable option naming folders or files (`path`: click.Path's exists, file_okay, ...)."""
    return click.option(flag, dest, multiple=True, type=click.Path(path_type=Path, **path), help=help)


def method_set_option(help_text: str) -> Decorator:
    """--method-set METHOD:KEY=VALUE, repeatable: an option for one method only (`harness sweep`, `harness compare`;
    parsed by harness.analysis.sweep.per_method_settings)."""
    return click.option("--method-set", multiple=True, metavar="METHOD:KEY=VALUE", help=help_text)


def cluster_options(command):
    """The cluster shape shared by every run of a sweep; unset ones keep RunConfig's defaults."""
    return _apply(
        [clusters_option(None), stages_option(None), backend_option(None), link_emulator_option(None)], command
    )


def train_options(command):
    """The training settings every method shares; unset ones keep TrainConfig's defaults. Method options are
    added by `WithMethodOptions`."""
    flags = [
        click.option(
            "--model",
            help="tiny, small, tiny-qwen, opt-125m, ..., or a local transformers config (a folder with config.json, "
            f"or a JSON file) [default: {TrainConfig.model}].",
        ),
        click.option("--steps", type=int, help=f"Training steps [default: {TrainConfig.steps}]."),
        click.option(
            "--batch-size", type=int, help=f"Sequences per replica per step [default: {TrainConfig.batch_size}]."
        ),
        click.option("--seq-len", type=int, help="Tokens per sequence [default: the model's context]."),
        click.option("--seed", type=int, help=f"Seed for weights and data order [default: {TrainConfig.seed}]."),
        click.option("--eval-every", type=int, help=f"Steps between validations [default: {TrainConfig.eval_every}]."),
        click.option(
            "--throughput-warmup-steps",
            type=int,
            help=f"Steps left out of tokens/s [default: {TrainConfig.throughput_warmup_steps}].",
        ),
        click.option("--microbatches", type=int, help="Pipeline micro-batches per step [default: --stages]."),
        click.option(
            "--pipeline-schedule",
            type=click.Choice(["1f1b", "gpipe"]),
            help=f"[default: {TrainConfig.pipeline_schedule}].",
        ),
        click.option("--lr", type=float, help=f"Inner AdamW peak learning rate [default: {OptimConfig.lr}]."),
        click.option(
            "--data",
            type=click.Path(),
            help="Text, JSONL or parquet file, a folder of them, or a saved datasets folder [default: the stdlib].",
        ),
        click.option(
            "--data-field",
            help=f"Field with the text of a JSONL/parquet/datasets record [default: {TrainConfig.data_field}].",
        ),
        click.option(
            "--tokenizer",
            help="bytes, bpe:N (a byte-level BPE of N tokens trained on the corpus, cached) or a local tokenizer.json "
            f"[default: {TrainConfig.tokenizer}].",
        ),
        click.option(
            "--data-shift",
            type=int,
            metavar="N",
            help="Every N steps move each replica's batches to another part of its data, to test methods under a "
            f"shifting distribution [default: {TrainConfig.data_shift} = off].",
        ),
    ]
    return _apply(flags, command)


class OptionalInt(click.ParamType):
    """An integer, or 'none' to switch the setting off (kept as the string: None means 'not given')."""

    name = "INTEGER|none"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or str(value).lower() == "none":
            return value if isinstance(value, int) else "none"
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is neither an integer nor 'none'", param, ctx)


def _click_type(option: MethodOption) -> Any:
    if typing.get_origin(option.kind) is typing.Literal:
        return click.Choice([str(v) for v in typing.get_args(option.kind)])
    if option.accepts_none:
        return OptionalInt()
    return option.kind


def method_option_params() -> list[click.Option]:
    """One flag per method option, generated from the methods' config dataclasses so the CLI never drifts."""
    params = []
    for field_name, option in sorted(method_options().items()):
        flag = field_name.replace("_", "-")
        used_by = "method option; " + ", ".join(f"{m}: {d}" for m, d in option.defaults.items())
        help_text = f"{option.help} [{used_by}]" if option.help else f"[{used_by}]"
        if option.kind is bool:
            params.append(click.Option([f"--{flag}/--no-{flag}", field_name], default=None, help=help_text))
        else:
            params.append(
                click.Option([f"--{flag}", field_name], type=_click_type(option), default=None, help=help_text)
            )
        if typing.get_origin(option.kind) is typing.Literal and "none" in typing.get_args(option.kind):
            # A switch that grew modes (dilocox's --overlap) keeps its --no-FLAG, as a hidden alias of --FLAG none.
            params.append(click.Option([f"--no-{flag}", field_name], flag_value="none", default=None, hidden=True))
    return params


class WithMethodOptions(click.Command):
    """A command that takes every method's options as flags; they are built (importing the methods, and torch)
    only when this command is parsed or its help printed, not when its module is imported."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        if not getattr(self, "_method_params_added", False):
            self.params.extend(method_option_params())
            self._method_params_added = True
        return super().get_params(ctx)
