"""Flags that several commands take, each declared once; the defaults they show come from the config dataclasses
(trainers/config.py, harness/run/config.py). A method's settings are no flags: `--set [METHOD.]KEY=VALUE`
(harness/run/settings.py) gives them on every command, and `harness methods` lists them."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from harness.backends import BACKENDS
from harness.run.config import LINK_EMULATORS, RunConfig
from harness.run.settings import SET_METAVAR, old_flag_message, takes_value
from trainers.config import OptimConfig, TrainConfig
from trainers.registry import method_names

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
    return click.option(
        "--method",
        default=default,
        show_default=True,
        help=f"One of: {', '.join(method_names())}; or path/to/file.py:Class, a method of your own "
        "(docs/writing-a-method.md).",
    )


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
    return _choice_option(
        "--backend",
        BACKENDS,
        default,
        RunConfig.backend,
        "Where the ranks run: netns (processes in network namespaces on this host) or docker (a container each).",
    )


def link_emulator_option(default: str | None = RunConfig.link_emulator) -> Decorator:
    return _choice_option(
        "--link-emulator",
        LINK_EMULATORS,
        default,
        RunConfig.link_emulator,
        "What adds a profile's delay, jitter and loss: netem, or the userspace delay line where the kernel "
        "has no sch_netem (auto picks; `harness doctor` says which this machine has).",
    )


class LossValue(click.ParamType):
    """A validation loss to reach: a cross-entropy, so a finite number above 0."""

    name = "LOSS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            loss = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number; give a validation loss such as 2.1", param, ctx)
        if not (math.isfinite(loss) and loss > 0):
            self.fail(f"{value} is not a loss a run can reach; give a finite number above 0, such as 2.1", param, ctx)
        return loss


def paths_option(flag: str, dest: str, help: str, **path: bool) -> Decorator:
    """A repeatable option naming folders or files (`path`: click.Path's exists, file_okay, ...)."""
    return click.option(flag, dest, multiple=True, type=click.Path(path_type=Path, **path), help=help)


def cluster_options(command):
    """The cluster shape shared by every run of a sweep; unset ones keep RunConfig's defaults."""
    return _apply(
        [clusters_option(None), stages_option(None), backend_option(None), link_emulator_option(None)], command
    )


def train_options(command=None, *, seed: bool = True):
    """The training settings every method shares; unset ones keep TrainConfig's defaults. Commands that run many
    seeds (sweep, compare) take --seeds instead of --seed. A method's settings go through --set."""
    if command is None:
        return lambda command: train_options(command, seed=seed)
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
        click.option("--seq-len", type=int, help="Tokens per sequence; 0 is the model's context [default: 0]."),
        *(
            [click.option("--seed", type=int, help=f"Seed for weights and data order [default: {TrainConfig.seed}].")]
            if seed
            else []
        ),
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
            help="Pipeline schedule when --stages > 1: 1f1b holds fewer activations than gpipe "
            f"[default: {TrainConfig.pipeline_schedule}].",
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


def selected_on_option(recorded_in: str) -> Decorator:
    """--selected-on of a study: which seeds chose which method's settings (harness/analysis/plan.py)."""
    return click.option(
        "--selected-on",
        multiple=True,
        metavar="METHOD=SEEDS",
        help=f"The seeds METHOD's settings were chosen on (repeatable), e.g. dilocox=3,4,5: recorded in {recorded_in}, "
        "and its rows on those seeds are labelled in-sample.",
    )


def set_option(help_text: str) -> Decorator:
    """--set [METHOD.]KEY=VALUE, repeatable: a method's setting, or a training or cluster setting
    (harness/run/settings.py)."""
    return click.option("--set", "assignments", multiple=True, metavar=SET_METAVAR, help=help_text)


class WithSettings(click.Command):
    """A command that takes --set. A method flag of before it (--local-steps 10, --no-final-sync, --method-set
    dilocox:rank=32) is refused in one sentence naming its --set form, rather than click's "no such option"."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        own = {flag for param in self.get_params(ctx) for flag in (*param.opts, *param.secondary_opts)}
        for i, word in enumerate(args):
            if word == "--":
                break
            if not word.startswith("--") or word.partition("=")[0] in own:
                continue
            wants_value = takes_value(word) or word == "--method-set"
            value = args[i + 1] if wants_value and i + 1 < len(args) else None
            message = old_flag_message(word, value)
            if message is not None:
                raise click.UsageError(message, ctx)
        return super().parse_args(ctx, args)
