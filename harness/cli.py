"""The `harness` command: parse, call the library, print. No logic lives here.

Heavy modules (torch, pyroute2, pandas) are imported inside the commands that use them, so `harness --help` and
`harness profiles list` answer at once; `import harness.cli` loads click, rich and yaml only.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import types
import typing
from pathlib import Path
from typing import Any

import click
import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from harness.errors import UserError
from harness.net.profiles import load_profile
from harness.run.config import RunConfig
from harness.units import format_rate
from trainers.config import OptimConfig, TrainConfig
from trainers.registry import method_names

console = Console()
errors = Console(stderr=True)


def _fail(message: str) -> typing.NoReturn:
    """Bad input: one plain line on stderr, exit code 2 (as click's own usage errors)."""
    errors.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    sys.exit(2)


class _Group(click.Group):
    """The one error path: click's usage errors and the library's UserError print as one line and exit 2;
    anything else is a bug and keeps its traceback."""

    def main(self, *args, **kwargs):
        try:
            return super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.Exit as done:
            sys.exit(done.exit_code)
        except click.UsageError as err:
            hint = f" (see harness {err.ctx.info_name} --help)" if err.ctx and err.ctx.parent else ""
            _fail(err.format_message() + hint)
        except UserError as err:
            _fail(str(err))
        except click.Abort:
            _fail("aborted")


def _method_options() -> dict[str, tuple[Any, dict[str, Any], str]]:
    """Every method config field, once: name -> (type, {method: default}, help). A field's help is its
    `metadata["help"]` in the method's config (the first method that gives one).

    A field that several methods share must have one type, except that one method may also accept None
    (e.g. cocktail's --bits none): the flag then accepts 'none' and the method that refuses it says so.
    """
    from trainers.registry import method_class, method_names

    options: dict[str, tuple[Any, dict[str, Any], str]] = {}
    for name in method_names():
        config_cls = method_class(name).config_class
        hints = typing.get_type_hints(config_cls)
        for f in dataclasses.fields(config_cls):
            kind = hints[f.name]
            if f.name in options:
                known, defaults, help_text = options[f.name]
                if _optional(kind) and not _optional(known):
                    options[f.name] = (kind, defaults, help_text)
                elif not ({_strip_none(kind), _strip_none(known)} <= {_strip_none(known)}):
                    raise TypeError(f"method option {f.name} has type {known} in one method and {kind} in {name}")
            kind, defaults, help_text = options.setdefault(f.name, (kind, {}, ""))
            defaults[name] = f.default
            if not help_text and f.metadata.get("help"):
                options[f.name] = (kind, defaults, f.metadata["help"] + " ")
    return options


def _optional(kind: Any) -> bool:
    return typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in typing.get_args(kind)


def _strip_none(kind: Any) -> Any:
    if not _optional(kind):
        return kind
    (inner,) = [k for k in typing.get_args(kind) if k is not type(None)]
    return inner


class _OptionalInt(click.ParamType):
    """An integer, or 'none' to switch the setting off (kept as the string: None means 'not given')."""

    name = "INTEGER|none"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or str(value).lower() == "none":
            return value if isinstance(value, int) else "none"
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is neither an integer nor 'none'", param, ctx)


def _click_type(kind: Any) -> Any:
    if typing.get_origin(kind) is typing.Literal:
        return click.Choice([str(v) for v in typing.get_args(kind)])
    if _optional(kind):
        return _OptionalInt()
    return kind


def _method_option_params() -> list[click.Option]:
    """One flag per method option, generated from the methods' config dataclasses so the CLI never drifts."""
    params = []
    for field_name, (kind, defaults, help_text) in sorted(_method_options().items()):
        flag = field_name.replace("_", "-")
        used_by = "method option; " + ", ".join(f"{m}: {d}" for m, d in defaults.items())
        help_text = f"{help_text}[{used_by}]"
        if kind is bool:
            params.append(click.Option([f"--{flag}/--no-{flag}", field_name], default=None, help=help_text))
        else:
            params.append(click.Option([f"--{flag}", field_name], type=_click_type(kind), default=None, help=help_text))
        if typing.get_origin(kind) is typing.Literal and "none" in typing.get_args(kind):
            # A switch that grew modes (dilocox's --overlap) keeps its --no-FLAG, as a hidden alias of --FLAG none.
            params.append(click.Option([f"--no-{flag}", field_name], flag_value="none", default=None, hidden=True))
    return params


class _WithMethodOptions(click.Command):
    """A command that takes every method's options as flags; they are built (importing the methods, and torch)
    only when this command is parsed or its help printed, not when `harness --help` lists it."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        if not getattr(self, "_method_params_added", False):
            self.params.extend(_method_option_params())
            self._method_params_added = True
        return super().get_params(ctx)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def main() -> None:
    """Benchmark harness for low-communication LLM training over slow, kernel-shaped links."""


def _reexec_if_unprivileged() -> None:
    from harness.userns import REEXEC_MARK, die_with_outer_harness, needs_reexec, reexec_in_user_namespace

    if os.environ.get(REEXEC_MARK):
        die_with_outer_harness()
        return
    if needs_reexec():
        sys.exit(reexec_in_user_namespace(sys.argv[1:]))


def _progress_bars() -> Progress:
    return Progress(
        # Never markup: descriptions hold run names and profile file names, statuses hold failure text.
        TextColumn("{task.description}", style="bold", markup=False),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[status]}", markup=False),
        TimeElapsedColumn(),
        console=console,
    )


def _progress_display():
    progress = _progress_bars()
    task = progress.add_task("starting", total=None, status="building cluster...")

    def update(state: dict[str, Any]) -> None:
        if "step" not in state:
            return
        parts = [f"loss {state['loss']:.3f}" if "loss" in state else ""]
        if "val_loss" in state:
            parts.append(f"val {state['val_loss']:.3f}")
        if state.get("step_s"):
            parts.append(f"{state['tokens'] / max(state['step'] + 1, 1) / state['step_s']:,.0f} tok/s")
        util = state.get("link_utilisation")
        parts.append(
            f"link {format_rate(state['link_bps'])}" + (f" ({util:.0%} of {state['link']})" if util is not None else "")
        )
        progress.update(
            task,
            description=f"step {state['step'] + 1}/{state['total_steps']}",
            completed=state["step"] + 1,
            total=state["total_steps"],
            status="  ".join(parts),
        )

    return progress, update


def _loss_line(summary: dict[str, Any]) -> str:
    """Whatever losses exist: a failed run may have no final training loss but a validation curve."""
    parts = []
    if summary.get("final_train_loss") is not None:
        parts.append(f"train {summary['final_train_loss']:.3f}")
    if summary.get("final_val_loss") is not None:
        parts.append(f"val {summary['initial_val_loss']:.3f} -> {summary['final_val_loss']:.3f}")
    return ", ".join(parts) or "-"


def _print_summary(summary: dict[str, Any]) -> None:
    table = Table(show_header=False, box=None, pad_edge=False)
    rows = [
        ("status", summary["status"] + (f" - {summary['failure']}" if summary.get("failure") else "")),
        (
            "method / profile",
            f"{summary['method']} on {summary['profile']} "
            f"({summary['clusters']} clusters x {summary['stages']} stages, {summary['backend']})",
        ),
        ("model", f"{summary['model']} ({summary['param_count'] / 1e6:.2f}M parameters)"),
        ("steps / tokens", f"{summary['steps']} / {summary['tokens']:,} trained, " + _applied(summary)),
        ("throughput", f"{summary['tokens_per_s']:,.0f} applied tokens/s" if summary.get("tokens_per_s") else "-"),
        ("loss", _loss_line(summary)),
        (
            "wire bytes",
            f"{summary['wire_bytes']:,} ({summary['wire_bytes_per_token']:.1f} per token; "
            f"method payload {summary['payload_bytes']:,})"
            if summary.get("wire_bytes")
            else "-",
        ),
    ]
    if summary.get("link_max_excess") is not None:
        verdict = "conforms" if summary["link_conforms"] else "BROKE the rate"
        rows.append(
            (
                "link",
                f"{verdict}: worst window {summary['link_max_excess']:.2f} x (rate x window + burst); "
                f"TCP retransmitted {summary.get('tcp_retransmit_fraction') or 0:.1%} of segments",
            )
        )
    if summary.get("link_rtt_ms") is not None:
        verdict = "matches the profile" if summary["link_check_ok"] else "MISSES the profile"
        loss = summary.get("link_loss_measured")
        rows.append(
            (
                "link delay",
                f"{verdict} ({summary['link_emulator']}): RTT {summary['link_rtt_ms']:.2f} ms median vs "
                f"{summary['link_rtt_target_ms']:g} ms, loss {loss:.2%} vs {summary['link_loss_target']:.2%} "
                f"({summary['link_probes']:,} probes)"
                if loss is not None
                else f"{verdict}: RTT {summary['link_rtt_ms']:.2f} ms vs {summary['link_rtt_target_ms']:g} ms",
            )
        )
    for fault in summary.get("faults") or []:
        restored = (
            f", restored after {fault['restored_t'] - fault['injected_t']:.1f} s" if "restored_t" in fault else ""
        )
        rows.append(("fault", f"{fault['fault']} injected at step {fault['injected_at_step']}{restored}"))
    if summary.get("link_busbw_bps"):
        rows.append(
            (
                "link busbw",
                f"{format_rate(summary['link_busbw_bps'])} measured vs "
                f"{format_rate(summary['link_rate_bps'])} configured",
            )
        )
    for key, value in rows:
        # Text, not markup: a failure holds the worker's error, e.g. gloo's "[/path/pair.cc:339] ...".
        table.add_row(Text(key, style="bold"), Text(value))
    console.print(table)
    _print_text(f"results: {summary['results_dir']}")


def _print_warnings(warnings: list[str]) -> None:
    for warning in warnings:
        errors.print(Text.assemble(("warning: ", "yellow"), warning), highlight=False, soft_wrap=True)


def _applied(summary: dict[str, Any]) -> str:
    """Applied tokens: those whose updates are in the final synchronized parameters (README, "What is measured")."""
    applied = summary.get("applied_tokens")
    return "-" if applied is None else f"{applied:,} applied"


def _print_text(text: str) -> None:
    """Untrusted text (paths, names, errors) printed as it is: never read as markup, never highlighted."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def train_option_flags(command):
    """The training settings every method shares; unset ones keep TrainConfig's defaults. Method options are
    added by `_WithMethodOptions`."""
    flags = [
        click.option("--model", help=f"tiny, small, tiny-qwen, opt-125m, ... [default: {TrainConfig.model}]."),
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
        click.option("--pipeline-schedule", type=click.Choice(["1f1b", "gpipe"]), help="[default: 1f1b]."),
        click.option("--lr", type=float, help=f"Inner AdamW peak learning rate [default: {OptimConfig.lr}]."),
        click.option("--data", type=click.Path(), help="Text file or folder to train on [default: Python's stdlib]."),
        click.option(
            "--data-shift",
            type=int,
            metavar="N",
            help="Every N steps move each replica's batches to another part of its data, to test methods under a "
            f"shifting distribution [default: {TrainConfig.data_shift} = off].",
        ),
    ]
    for flag in reversed(flags):
        command = flag(command)
    return command


def _link_emulator_flag(default: str | None = "auto"):
    return click.option(
        "--link-emulator",
        default=default,
        show_default=default is not None,
        type=click.Choice(["auto", "netem", "userspace"]),
        help="What adds a profile's delay, jitter and loss: netem, or the userspace delay line where the kernel "
        "has no sch_netem (auto picks; `harness doctor` says which this machine has)."
        + ("" if default else " [default: auto]"),
    )


@main.command(cls=_WithMethodOptions)
@click.option("--profile", default="1gbps", show_default=True, help="Profile name or path to a profile YAML.")
@click.option("--method", default="allreduce", show_default=True, help=f"One of: {', '.join(method_names())}.")
@click.option("--clusters", default=2, show_default=True, help="Sites joined by the shaped link.")
@click.option("--stages", default=1, show_default=True, help="Pipeline stages (ranks) per cluster.")
@click.option("--out", type=click.Path(path_type=Path), help="Results folder [default: results/runs/<run_id>].")
@click.option("--calibrate", is_flag=True, help="Measure the link's all-reduce busbw before training.")
@click.option("--backend", default="netns", show_default=True, type=click.Choice(["netns", "docker"]))
@_link_emulator_flag()
@click.option(
    "--fault",
    "faults",
    multiple=True,
    metavar="KIND:STEP:ARG",
    help="Inject a fault when rank 0 has done STEP steps (repeatable): link-down:STEP:SECONDS, rate:STEP:RATE "
    "(e.g. rate:50:100mbit), kill:STEP:RANK.",
)
@click.option(
    "--gpus",
    default="auto",
    show_default=True,
    help="Docker backend: one GPU per rank: auto (GPU r for rank r with the nvidia runtime), none, or ids 0,1.",
)
@train_option_flags
def run(method, profile, clusters, stages, out, calibrate, backend, link_emulator, faults, gpus, **settings):
    """Train one method on the emulated cluster and write a results folder."""
    from harness.run.runner import run as run_benchmark
    from harness.run.runner import validate

    config = RunConfig.build(
        method,
        profile,
        clusters=clusters,
        stages=stages,
        backend=backend,
        link_emulator=link_emulator,
        faults=faults,
        gpus=gpus,
        calibrate=calibrate,
        **settings,
    )
    validate(config, out)
    _print_warnings(config.warnings())
    _reexec_if_unprivileged()
    progress, update = _progress_display()
    _signals_belong_to_the_run()
    with progress:
        summary = run_benchmark(config, out, on_progress=update)
    _print_summary(summary)
    sys.exit(_exit_code(summary))


def _exit_code(summary: dict[str, Any]) -> int:
    """0 ok, 1 failed; a run stopped by a signal exits as the shell expects (128 + N: 130 for Ctrl-C)."""
    if not summary.get("interrupted_by"):
        return 0 if summary["status"] == "ok" else 1
    return 128 + signal.Signals[summary["interrupted_by"]].value


def _signals_belong_to_the_run() -> None:
    """From here on SIGINT and SIGTERM are the runner's: it stops the run at the first and tears down; any that
    come after the run returns, while the summary prints, are ignored rather than turned into a traceback."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


@main.command()
@click.option("--profile", default="1gbps", show_default=True, help="Profile name or path to a profile YAML.")
@click.option("--clusters", default=2, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), help="Results folder [default: results/runs/<run_id>].")
@click.option("--backend", default="netns", show_default=True, type=click.Choice(["netns", "docker"]))
@_link_emulator_flag()
def calibrate(profile, clusters, out, backend, link_emulator):
    """Measure all-reduce bus bandwidth across the clusters on the shaped link."""
    from harness.run.runner import run as run_benchmark
    from harness.run.runner import validate

    config = RunConfig.build(
        "allreduce",
        profile,
        clusters=clusters,
        backend=backend,
        link_emulator=link_emulator,
        mode="calibrate",
        calibrate=True,
    )
    validate(config, out)
    _reexec_if_unprivileged()
    summary = run_benchmark(config, out)
    if summary["status"] != "ok":
        errors.print(
            f"error: calibration failed: {summary['failure']} (results: {summary['results_dir']})",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(1)
    busbw, rate = summary["link_busbw_bps"], summary["link_rate_bps"]
    ratio = f" = {busbw / rate:.3f} of the configured rate" if rate else ""
    _print_text(
        f"profile {summary['profile']}: all-reduce busbw {format_rate(busbw)} across {clusters} clusters, "
        f"configured {format_rate(rate) if rate else 'unshaped'}{ratio}"
    )
    _print_text(f"results: {summary['results_dir']}")


@main.group()
def profiles() -> None:
    """Network profiles (netem_profiles/*.yaml)."""


@profiles.command("list")
def profiles_list() -> None:
    """The named profiles: the inter-cluster link's rate, round-trip time and loss side by side."""
    from harness.net.profiles import profiles_table_rows

    table = Table("name", "rate", "RTT", "jitter", "loss", "description")
    for column in table.columns[:-1]:
        column.no_wrap = True
    for row in profiles_table_rows():
        table.add_row(*(Text(str(row[key])) for key in ("name", "rate", "rtt", "jitter", "loss", "description")))
    console.print(table)


@profiles.command("export")
@click.argument("name")
@click.option("--format", "fmt", type=click.Choice(["tcconfig"]), default="tcconfig", show_default=True)
@click.option("--device", default="eth0", show_default=True, help="The interface the settings are for.")
@click.option("--out", default="-", show_default=True, help="File to write, or - for standard output.")
@click.option("--allow-reorder", is_flag=True, help="Export jitter although netem (which tcset drives) reorders.")
def profiles_export(name: str, fmt: str, device: str, out: str, allow_reorder: bool) -> None:
    """Write a profile's inter-cluster link for real hosts: `tcset --import-setting FILE` on each site's NIC."""
    from harness.net.tcconfig import write_tcconfig

    write_tcconfig(load_profile(name), out, device=device, allow_reorder=allow_reorder)


@profiles.command("show")
@click.argument("name")
def profiles_show(name: str) -> None:
    """A profile's YAML and how it is read."""
    p = load_profile(name)
    click.echo(f"# {p.source}")
    click.echo(Path(p.source).read_text().rstrip())
    click.echo(f"# inter-cluster: {p.inter_cluster.describe()}")
    click.echo(f"# intra-cluster: {p.intra_cluster.describe()}")
    for line in p.topology_lines():
        click.echo(f"# topology: {line}")
    click.echo(yaml.safe_dump({"parsed": p.to_dict()}, sort_keys=False).rstrip())


@main.command("bench-cluster")
@click.option("--profile", default="1gbps", show_default=True)
@click.option("--clusters", default=2, show_default=True)
@click.option("--stages", default=1, show_default=True)
@click.option("--repeats", default=10, show_default=True)
def bench_cluster(profile: str, clusters: int, stages: int, repeats: int) -> None:
    """Benchmark building and removing the emulated cluster (namespaces, bridge, veths, qdiscs)."""
    from harness.benchmarks import cluster_lifecycle

    prof = load_profile(profile)
    _reexec_if_unprivileged()
    figures = cluster_lifecycle(prof, clusters, stages, repeats)
    _print_text(
        f"{clusters} clusters on {profile}, {repeats} repeats: setup {figures['setup_median_s'] * 1000:.0f} ms, "
        f"teardown {figures['teardown_median_s'] * 1000:.0f} ms, total {figures['total_median_s'] * 1000:.0f} ms "
        f"median ({figures['total_max_s'] * 1000:.0f} ms max)"
    )


@main.command("bench-delayline")
@click.option("--rate", default="1gbit", show_default=True, help="Link rate (tc units), or 'none' for unshaped.")
@click.option("--rtt-ms", default="0,40", show_default=True, help="Comma-separated RTTs through the delay line.")
@click.option("--seconds", default=5.0, show_default=True, help="Measured seconds per stream (after 1 s of warmup).")
@click.option("--repeats", default=3, show_default=True)
@click.option("--loss", default="0%", show_default=True, help="Loss through the delay line (> 0: wire-sized packets).")
@click.option(
    "--window-bytes",
    type=click.IntRange(min=1),
    help="Clamp the stream's window (the receiver's TCP_WINDOW_CLAMP), e.g. 2097152: what gloo's all-reduce keeps "
    "in flight.",
)
def bench_delayline(rate: str, rtt_ms: str, seconds: float, repeats: int, loss: str, window_bytes: int | None) -> None:
    """Benchmark the userspace delay line: one TCP stream without it and through it at each RTT."""
    from harness.benchmarks import delay_line_goodput
    from harness.net.link import parse_loss_pct, parse_rate_bps

    rate_bps = None if rate == "none" else parse_rate_bps(rate)
    loss_pct = parse_loss_pct(loss)
    rtts = [float(r) for r in _csv(rtt_ms)]
    _reexec_if_unprivileged()
    table = Table("emulator", "rate", "RTT", "loss", "goodput (median, min-max)", "window bound")
    for row in delay_line_goodput(rate_bps, rtts, seconds, repeats, loss_pct, window_bytes):
        bound = row["window_bound_bps"]
        table.add_row(
            row["emulator"],
            format_rate(rate_bps) if rate_bps else "unshaped",
            f"{row['rtt_ms']:g} ms",
            f"{row['loss_pct']:g}%",
            f"{format_rate(row['goodput_bps'])} ({format_rate(row['goodput_min_bps'])}-"
            f"{format_rate(row['goodput_max_bps'])}, n={repeats})",
            f"{format_rate(bound)} (window {row['window_bytes']:,} B)" if bound else "-",
        )
    console.print(table)


@main.command()
@click.option("--run-key", help="Only this run's leftovers (the hx...... prefix in config.json's run_key).")
@click.option(
    "--results",
    "results_dirs",
    multiple=True,
    type=click.Path(path_type=Path, file_okay=False),
    help="A folder of results folders whose staging folders (.<name>.partial) to check, one level deep; "
    "repeatable (default: results/runs).",
)
def cleanup(run_key: str | None, results_dirs: tuple[Path, ...]) -> None:
    """Remove what a harness killed with SIGKILL left: namespaces, containers, networks, results staging folders.

    Only runs whose harness is provably dead (its run lock is free) are touched, never a live run's.
    """
    from harness.cleanup import cleanup as cleanup_runs

    report = cleanup_runs(run_key, list(results_dirs) or None)
    for sentence in report.not_checked:
        _print_text(sentence)
    _print_text(report.describe())


@main.command()
def doctor() -> None:
    """What this machine can do, and which profiles and backends that allows."""
    from harness.doctor import diagnose

    table = Table("check", "result", "what it means")
    for check in diagnose():
        result = Text.assemble(("yes", "green") if check.ok else ("no", "red"), " ", check.detail)
        table.add_row(Text(check.name), result, Text(check.meaning))
    console.print(table)


# --- sweeps, reports, figures, regime matching and the CI gate (harness/analysis/) ---


def _cluster_flags(command):
    """The cluster shape shared by every run of a sweep; unset ones keep RunConfig's defaults."""
    flags = [
        click.option("--clusters", type=int, help="Sites joined by the shaped link [default: 2]."),
        click.option("--stages", type=int, help="Pipeline stages (ranks) per cluster [default: 1]."),
        click.option("--backend", type=click.Choice(["netns", "docker"]), help="[default: netns]"),
        _link_emulator_flag(default=None),
    ]
    for flag in reversed(flags):
        command = flag(command)
    return command


def _csv(text: str, kind: type = str) -> tuple:
    try:
        return tuple(kind(item.strip()) for item in text.split(",") if item.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r} must be a comma-separated list of {kind.__name__}s") from None


class _SweepProgress:
    """A bar for the sweep and one for the run in progress; a line per finished run."""

    def __init__(self) -> None:
        self.bars = _progress_bars()
        self.sweep = self.bars.add_task("sweep", total=None, status="")
        self.run: Any = None

    def started(self, combo, position: int, total: int) -> None:
        self.bars.update(self.sweep, description=f"run {position}/{total}", total=total, completed=position - 1)
        self.run = self.bars.add_task(combo.name, total=None, status="building cluster...")

    def progress(self, state: dict[str, Any]) -> None:
        if "step" not in state:
            return
        status = f"loss {state['loss']:.3f}  link {format_rate(state['link_bps'])}" if "loss" in state else ""
        self.bars.update(self.run, completed=state["step"] + 1, total=state["total_steps"], status=status)

    def finished(self, row) -> None:
        if self.run is not None:
            self.bars.remove_task(self.run)
            self.run = None
        self.bars.advance(self.sweep)
        speed = f"{row.tokens_per_s:,.0f} tokens/s" if row.tokens_per_s else ""
        if row.skipped:
            line = Text.assemble(("skip", "dim"), f"   {row.combination.name} (finished earlier) {speed}")
        elif row.status == "ok":
            line = Text.assemble(("ok", "green"), f"     {row.combination.name} {speed}")
        else:
            line = Text.assemble(("failed", "red"), f" {row.combination.name}: {row.failure}")
        self.bars.console.print(line, highlight=False)


@main.command(cls=_WithMethodOptions)
@click.option("--methods", required=True, help=f"Comma-separated methods ({', '.join(method_names())}).")
@click.option("--profiles", default="", help="Comma-separated profile names or profile YAML paths.")
@click.option("--seeds", default="0", show_default=True, help="Comma-separated seeds.")
@click.option(
    "--set",
    "grid",
    multiple=True,
    metavar="KEY=V1,V2",
    help="Sweep a setting (repeatable; the product is run), e.g. local_steps=10,50 or stages=1,2. "
    "A method option goes only to the methods that have it.",
)
@click.option(
    "--method-set",
    multiple=True,
    metavar="METHOD:KEY=VALUE",
    help="Fix an option for one method only (repeatable), e.g. opendiloco:local_steps=20.",
)
@click.option(
    "--regime",
    metavar="TARGET",
    help="Add a profile whose link rate makes AllReduce as communication-bound as TARGET (paper-107b); "
    "measured once, written to OUT/profiles/TARGET.yaml.",
)
@click.option("--repeats", default=1, show_default=True, help="Runs per combination (e.g. for medians).")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Sweep folder (resumed if it exists).")
@click.option("--force", is_flag=True, help="Rerun finished combinations (and re-derive the regime profile).")
@_cluster_flags
@train_option_flags
def sweep(methods, profiles, seeds, grid, method_set, regime, repeats, out, force, **flags):
    """Run methods x profiles x seeds (x --set values) one after another into one sweep folder.

    Round-robin: for each seed (and repeat), each profile, every method runs back to back, so machine noise falls
    on all methods alike. A finished combination (summary.json with status ok) is skipped, so rerunning the command
    resumes an interrupted sweep; a failed run is recorded and the sweep goes on. OUT/index.csv lists every run;
    OUT/sweep.json holds the command line that makes the sweep.
    """
    import shlex

    from harness.analysis.regime import regime_profile
    from harness.analysis.sweep import SweepInterrupted, SweepSpec, parse_set, per_method_settings, run_sweep

    settings = {k: v for k, v in flags.items() if v is not None}
    spec = SweepSpec(
        methods=_csv(methods),
        profiles=_csv(profiles),
        seeds=_csv(seeds, int),
        grid=tuple(parse_set(g) for g in grid),
        settings=settings,
        per_method=per_method_settings(method_set),
        repeats=repeats,
    )
    spec.validate(regime_pending=regime is not None)
    if spec.profiles:
        _print_warnings(spec.warnings())
    _reexec_if_unprivileged()
    if regime is not None:
        path, derived = regime_profile(regime, settings, out, force)
        _print_text(derived.describe() if derived else f"regime {regime}: reusing {path}")
        spec = dataclasses.replace(spec, profiles=(*spec.profiles, str(path)))
    display = _SweepProgress()
    try:
        with display.bars:
            rows = run_sweep(spec, out, force=force, observer=display, command=shlex.join(["harness", *sys.argv[1:]]))
    except SweepInterrupted as err:
        console.print(
            Text.assemble(("sweep interrupted", "yellow"), f" ({err}); run the same command again to resume it")
        )
        sys.exit(130)
    failed = [r for r in rows if r.status != "ok"]
    _print_text(
        f"{len(rows) - len(failed)} of {len(rows)} runs ok; index: {out / 'index.csv'}; next: harness report {out}"
    )
    sys.exit(1 if failed else 0)


@main.command()
@click.option("--target", default="paper-107b", show_default=True, help="The published regime to match.")
@click.option(
    "--out", type=click.Path(path_type=Path), help="Profile YAML to write [default: results/profiles/TARGET-MODEL.yaml]"
)
@_cluster_flags
@train_option_flags
def regime(target, out, seed, **flags):
    """Derive the link rate at which AllReduce is as communication-bound as TARGET, and write it as a profile.

    Measures this machine's compute time per step with a few `local` steps, then
    rate = 8 P / (R T_c): P gradient bytes per step on a cluster's uplink, R = T_comm / T_c of the target.
    Takes the same flags as `harness sweep`; method options do not change the measurement.
    """
    import tempfile

    from harness.analysis.regime import check_request, derive_regime, write_regime_profile

    del seed  # accepted like sweep's flags; weights' seed does not change compute time
    settings = {k: v for k, v in flags.items() if v is not None}
    check_request(target, settings)
    _reexec_if_unprivileged()
    with tempfile.TemporaryDirectory(prefix="harness-regime-") as work:
        derived = derive_regime(target, settings, Path(work))
    path = write_regime_profile(derived, out or Path("results") / "profiles" / f"{target}-{derived.model}.yaml")
    _print_text(derived.describe())
    _print_text(f"profile: {path} (use it with --profile {path}); measurements: {path.with_suffix('.json')}")


@main.command()
@click.argument("results", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option(
    "--target-loss",
    type=float,
    help="Validation loss for the tokens/time-to-target columns [default: per group, allreduce's final "
    "validation loss (mean over its runs) x 1.05; a group without allreduce needs this option, else those "
    "columns are not computed]. A run that never gets there shows 'not reached'.",
)
@click.option("--csv", "csv_path", type=click.Path(path_type=Path), help="Write the comparison as CSV.")
@click.option("--parquet", "parquet_path", type=click.Path(path_type=Path), help="Write it as parquet (needs pyarrow).")
@click.option(
    "--tables", type=click.Path(path_type=Path), help="Write the tidy runs.csv, events.csv and sites.csv here."
)
def report(results, target_loss, csv_path, parquet_path, tables):
    """Compare runs (run folders, sweep folders, or folders of them) as a markdown table per profile.

    Per method: n (runs aggregated), then each figure as its mean ± the 95% interval (n >= 3), its range (n = 2), or
    "n=1, no spread"; applied (and, where different, trained) tokens/s, ratios to allreduce and local (paired per
    seed where both ran it), compute utilisation (tokens/s over the run's own compute ceiling), wire bytes, final
    validation loss, and tokens and time to the target loss. Where sites differ in rate or there are more than two,
    a per-site table follows: each site's wire bytes and the time its replica waited on the link.
    """
    from harness.analysis.report import (
        comparison,
        load_runs,
        markdown,
        site_comparison,
        write_csv,
        write_parquet,
        write_tables,
    )

    loaded = load_runs(list(results))
    compared = comparison(loaded, target_loss)
    written = []
    if csv_path:
        written.append(write_csv(compared, csv_path))
    if parquet_path:
        written.append(write_parquet(compared, parquet_path))
    if tables:
        written += write_tables(loaded, tables)
    click.echo(markdown(compared, loaded.runs, site_comparison(loaded)))
    for path in written:
        _print_text(f"wrote {path}")


@main.command(cls=_WithMethodOptions)
@click.option("--method", default="dilocox", show_default=True, help=f"One of: {', '.join(method_names())}.")
@click.option(
    "--model", default="tiny", show_default=True, help="Any known model, e.g. tiny, small, opt-1.3b, qwen1.5-107b."
)
@click.option("--profile", default="1gbps", show_default=True, help="Profile name or path: the link's rate and RTT.")
@click.option("--clusters", default=2, show_default=True, help="Sites.")
@click.option("--batch-size", type=int, help=f"Sequences per site per step [default: {TrainConfig.batch_size}].")
@click.option("--seq-len", type=int, help="Tokens per sequence [default: the model's context].")
@click.option(
    "--compute-from",
    multiple=True,
    type=click.Path(exists=True, path_type=Path),
    help="Runs (folders of runs) of this method on this machine to measure compute from, scaled by FLOPs to the "
    "model and batch (repeatable).",
)
@click.option("--compute-s", type=float, help="Seconds per step of compute, given.")
@click.option("--accelerator-tflops", type=float, help="Peak TFLOP/s of one accelerator in the training dtype.")
@click.option("--accelerators-per-site", type=int, help="Accelerators per site (with --accelerator-tflops).")
@click.option("--mfu", type=float, help="Model FLOPs utilisation the accelerators reach (with --accelerator-tflops).")
@click.option(
    "--efficiency",
    type=float,
    default=None,
    help="Payload share of the link rate TCP reaches [default: 0.94, measured by harness calibrate].",
)
@click.option("--window-bytes", type=int, help="Bytes TCP keeps in flight [default: 2/3 of tcp_wmem's maximum].")
@click.option(
    "--validate",
    "validate_results",
    multiple=True,
    type=click.Path(exists=True, path_type=Path),
    help="Instead: predict every method and profile of these runs, with compute from --compute-from's runs of the "
    "same settings (on an unshaped link), and print predicted vs measured (repeatable).",
)
@click.option("--csv", "csv_path", type=click.Path(path_type=Path), help="--validate: write the table as CSV.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write the prediction (or table) as JSON.")
def project(
    method, model, profile, clusters, batch_size, seq_len, compute_from, compute_s, accelerator_tflops,
    accelerators_per_site, mfu, efficiency, window_bytes, validate_results, csv_path, json_path, **options,
):  # fmt: skip
    """Predict tokens/s and wire bytes per token from measured compute, a link model and the method's schedule.

    The model (harness/analysis/project.py): a step takes its compute plus the part of each exchange that the compute
    beside it does not hide; an exchange's time is its bytes over min(efficiency x the slowest site's rate, TCP
    window / RTT) plus a round trip per hand-over (gloo's all-reduce hands over two 1 MiB segments at a time).
    Compute comes from --compute-from (this machine, scaled by FLOPs), --compute-s, or a target accelerator
    (--accelerator-tflops, --accelerators-per-site, --mfu).
    """
    import json

    from harness.analysis import project as project_model
    from harness.analysis.report import markdown_table

    if validate_results:
        if not compute_from:
            raise click.UsageError("--validate needs --compute-from: runs of the same settings on an unshaped link")
        rows = project_model.validate(list(validate_results), list(compute_from))
        header = ["model", "profile", "method", "n", "measured tokens/s", "predicted", "error"]
        cells = [
            [r["model"], r["profile"], r["method"], str(r["n"]),
             f"{r['measured_tokens_per_s']:,.0f} ({r['measured_min']:,.0f}-{r['measured_max']:,.0f})",
             f"{r['predicted_tokens_per_s']:,.0f}", f"{r['error']:+.1%}"]
            for r in rows
        ]  # fmt: skip
        click.echo(markdown_table(header, cells, text_columns=3))
        worst = max(rows, key=lambda r: abs(r["error"]))
        within = sum(abs(r["error"]) <= project_model.VALIDATION_TOLERANCE for r in rows)
        click.echo(
            f"\n{within} of {len(rows)} within {project_model.VALIDATION_TOLERANCE:.0%}; largest error "
            f"{worst['error']:+.1%} ({worst['method']} on {worst['profile']}, model {worst['model']})"
        )
        if csv_path:
            import pandas as pd

            from harness.analysis.report import write_csv

            _print_text(f"wrote {write_csv(pd.DataFrame(rows), csv_path)}")
        if json_path:
            Path(json_path).write_text(json.dumps(rows, indent=2) + "\n")
            _print_text(f"wrote {json_path}")
        return
    accelerator = None
    if accelerator_tflops is not None or accelerators_per_site is not None or mfu is not None:
        if None in (accelerator_tflops, accelerators_per_site, mfu):
            raise click.UsageError("--accelerator-tflops, --accelerators-per-site and --mfu go together")
        accelerator = project_model.Accelerator(accelerator_tflops, accelerators_per_site, mfu)
    settings = {"batch_size": batch_size, "seq_len": seq_len, **options}
    prediction = project_model.project(
        method, model, profile, clusters, settings, list(compute_from), compute_s, accelerator,
        project_model.DEFAULT_EFFICIENCY if efficiency is None else efficiency, window_bytes,
    )  # fmt: skip
    for line in prediction.describe():
        _print_text(line)
    _print_text("assumptions: " + "; ".join(project_model.ASSUMPTIONS))
    if json_path:
        Path(json_path).write_text(json.dumps(prediction.record(), indent=2) + "\n")
        _print_text(f"wrote {json_path}")


@main.command()
@click.argument("results", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), help="Figure folder [default: RESULTS/figures].")
def plot(results, out):
    """Loss, throughput and step-time figures (PNG and SVG), one set per profile and model."""
    from harness.analysis.plots import plot_all
    from harness.analysis.report import load_runs

    written = plot_all(load_runs(list(results)), out or results[0] / "figures")
    for path in written:
        _print_text(f"wrote {path}")


@main.command()
@click.option("--baseline", required=True, type=click.Path(path_type=Path), help="Baseline YAML (the bands to hold).")
@click.option(
    "--results",
    type=click.Path(exists=True, path_type=Path),
    help="Read the runs from this folder instead of running them (they must be made with the baseline's run:).",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    help="Runs per method and profile; the median counts [default: the baseline's run: repeats].",
)
@click.option(
    "--out", type=click.Path(path_type=Path), help="Where new runs go [default: a new harness-check-* temp folder]."
)
def check(baseline, results, repeats, out):
    """Exit 1 when a metric falls outside its band in the baseline; 0 when all hold; 2 on a bad baseline.

    Per method and profile: utilisation (tokens/s over local's), ratio (over allreduce's), wire bytes per applied
    token, final validation loss. A band holds when reference / (1 + tolerance) <= measured <= reference x (1 +
    tolerance); the loss has only the upper bound.
    """
    import tempfile

    from harness.analysis.gate import check, load_baseline, results_table, run_needed

    spec = load_baseline(baseline)
    if results is None:
        _reexec_if_unprivileged()
        results = out or Path(tempfile.mkdtemp(prefix="harness-check-"))
        count = repeats or spec.repeats
        _print_text(f"running what {baseline} needs ({count} run(s) each) into {results}")
        display = _SweepProgress()
        with display.bars:
            run_needed(spec, results, count, observer=display)
    if repeats is not None and repeats < spec.repeats:
        _print_text(f"note: {repeats} run(s) each, fewer than the {spec.repeats} the bands were derived for")
    outcomes = check(spec, [results])
    click.echo(results_table(outcomes))
    outside = [o for o in outcomes if not o.ok]
    click.echo(f"{len(outcomes) - len(outside)} of {len(outcomes)} bands hold")
    click.echo(f"runs: {results}")
    sys.exit(1 if outside else 0)


@main.command("baseline")
@click.argument("results", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Baseline YAML to write.")
def baseline_command(results, out):
    """Write a baseline for `harness check` from RESULTS, a folder of repeats (a sweep with --repeats 3).

    Every method gets two-sided bands (module doc of harness/analysis/gate.py): reference = the median over its repeats,
    tolerance = max(floor, 3 x their relative spread). RESULTS must hold allreduce and local runs and one
    configuration per method. The file's header holds the one command that regenerates it.
    """
    from harness.analysis.gate import bands_table, write_baseline

    derived = write_baseline(results, out)
    click.echo(bands_table(derived.baseline))
    _print_text(f"wrote {out}; check with: harness check --baseline {out}")


if __name__ == "__main__":
    main()
