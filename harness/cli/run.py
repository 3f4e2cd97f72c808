"""`harness run` and `harness calibrate`: one run on the emulated cluster."""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.table import Table
from rich.text import Text

from harness.cli.common import console, errors, print_text, print_warnings, progress_bars, reexec_if_unprivileged
from harness.cli.options import (
    WithSettings,
    backend_option,
    clusters_option,
    link_emulator_option,
    method_option,
    profile_option,
    set_option,
    stages_option,
    train_options,
)
from harness.run.config import RunConfig, resolve_method
from harness.units import format_rate

out_option = click.option(
    "--out", type=click.Path(path_type=Path), help="Results folder [default: results/runs/<run_id>]."
)


class _SignalsBeforeTheRun:
    """SIGINT and SIGTERM from the start of parsing the command's flags until the runner takes them over: recorded,
    never raised, so that none is lost (SIG_IGN lost them) and none interrupts the command halfway.

    Parsing `harness run` imports torch, whose C initialisation swallows a KeyboardInterrupt raised while it
    imports numpy: the run went on with numpy half-imported and failed in its teardown, leaving its staging folder.
    One that arrives before `runner.execute` is called stops the command (`stop_if_received`: nothing exists yet). One
    that arrives inside `runner.execute` before the runner has installed its own handlers is passed on to those as
    soon as they are in place, and the runner stops the run and removes what it built.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self.previous = {sig: signal.signal(sig, self._record) for sig in self.SIGNALS}

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _record(self, signum: int, frame: Any) -> None:
        self.received = self.received or signal.Signals(signum)
        threading.Thread(target=self._pass_on, args=(signum,), daemon=True).start()

    def _pass_on(self, signum: int) -> None:
        # Only the main thread may install a handler and nothing tells this one when it has, hence the polling;
        # the runner installs its handlers within milliseconds of being called.
        while (handler := signal.getsignal(signum)) == self._record:
            time.sleep(0.001)
        # Not to the handlers of before (the command is over) nor to SIG_IGN (the run is over).
        if handler not in (self.previous[signum], signal.SIG_IGN):
            os.kill(os.getpid(), signum)

    def stop_if_received(self) -> None:
        if self.received is not None:
            errors.print(
                f"interrupted by {self.received.name} before the run started; nothing was created",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            sys.exit(128 + self.received)

    def ignore(self) -> None:
        """After the run, to the end of the process: a signal while the summary prints or Python exits is ignored
        rather than turned into a traceback (or, once Python has reset its handlers on exit, a death by signal)."""
        self.previous = dict.fromkeys(self.SIGNALS, signal.SIG_IGN)
        self.restore()


class _RecordsSignals(click.Command):
    """A command whose SIGINT and SIGTERM `_SignalsBeforeTheRun` records from the start of parsing to the end;
    the callback finds it in `ctx.meta`."""

    def make_context(self, info_name, args, parent=None, **extra) -> click.Context:
        signals = _SignalsBeforeTheRun()
        try:
            ctx = super().make_context(info_name, args, parent, **extra)
        except BaseException:  # --help, a usage error: the command ends here
            signals.restore()
            raise
        ctx.meta[_SignalsBeforeTheRun] = signals
        ctx.call_on_close(signals.restore)
        return ctx


class _RunCommand(_RecordsSignals, WithSettings):
    pass


@click.command("run", cls=_RunCommand)
@profile_option
@method_option("allreduce")
@clusters_option()
@stages_option()
@out_option
@click.option("--calibrate", is_flag=True, help="Measure the link's all-reduce busbw before training.")
@click.option(
    "--tensorboard",
    is_flag=True,
    help="Write loss, validation loss, tokens/s, link use and every exchange's figures as TensorBoard event files "
    "in the run folder's tensorboard/ while it trains (needs the tensorboard package).",
)
@click.option(
    "--wandb",
    is_flag=True,
    help="Log the same scalars, the config and the summary to Weights & Biases while it trains (WANDB_PROJECT, "
    "default harness; WANDB_MODE=offline writes them into the run folder's wandb/ for a later wandb sync).",
)
@backend_option()
@link_emulator_option()
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
    default=RunConfig.gpus,
    show_default=True,
    help="Docker backend: one GPU per rank: auto (GPU r for rank r with the nvidia runtime), none, or ids 0,1.",
)
@train_options
@set_option(
    "A setting of the method (repeatable), e.g. rank=32 or dilocox.overlap=delayed, or a training setting without a "
    "flag, e.g. threads_per_rank=1; `harness methods METHOD` lists the method's settings."
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, path_type=Path),
    help="Run what a run folder's config.json (or the folder, or a YAML with its keys) describes; flags given "
    "beside it override its settings.",
)
@click.option(
    "--resume",
    "resume_dir",
    type=click.Path(path_type=Path),
    metavar="RUN_DIR",
    help="Continue the interrupted run in RUN_DIR (its results folder, or the staging folder a killed harness left) "
    "from its latest checkpoint (a run made with --set checkpoint_every=STEPS), in that folder, with its own settings.",
)
@click.pass_context
def run(ctx, method, profile, out, assignments, config_file, resume_dir, **settings):
    """Train one method on the emulated cluster and write a results folder."""
    from harness.run import runner
    from harness.run.inputs import check_unchanged
    from harness.run.settings import parse_assignments, run_settings, settings_from_file

    signals = ctx.meta[_SignalsBeforeTheRun]
    if resume_dir is not None:
        _resume(ctx, signals, resume_dir)
    # Every other flag is a RunConfig.build setting by the same name: the cluster's shape, backend, link emulator,
    # faults and GPUs, and the training settings; --set adds the method's settings.
    given = {k: v for k, v in settings.items() if v is not None and _on_command_line(ctx, k)}
    base: dict[str, Any] = {}
    if config_file is not None:
        from_file = settings_from_file(config_file)
        if _on_command_line(ctx, "method") and method != from_file.method:
            raise click.UsageError(f"{config_file} is a run of {from_file.method}; leave out --method {method}")
        method, base = from_file.method, from_file.settings
        profile = profile if _on_command_line(ctx, "profile") else from_file.profile
    else:
        given = {k: v for k, v in settings.items() if v is not None}
        method = resolve_method(method)
    method_settings = run_settings(method, parse_assignments(assignments))
    config = RunConfig.build(method, profile, **{**base, **given, **method_settings})
    if config_file is not None:
        overridden = {"model_config", "model_checkpoint"} if "model" in given else set()
        overridden |= {k for k in ("data", "tokenizer") if k in given}
        recorded = {k: v for k, v in from_file.inputs.items() if k not in overridden}
        check_unchanged(recorded, config.train, config_file, config.method_source)
    summary = _validate_and_execute(signals, lambda: runner.validate(config, out))
    print_summary(summary, _same_setup(ctx, given, assignments))
    sys.exit(_exit_code(summary))


def _resume(ctx: click.Context, signals: _SignalsBeforeTheRun, run_dir: Path) -> None:
    """`harness run --resume RUN_DIR`: the run's own settings, nothing else."""
    from harness.run import runner

    others = sorted(
        f"--{name.replace('_', '-')}" for name in ctx.params if name != "resume_dir" and _on_command_line(ctx, name)
    )
    if others:
        raise click.UsageError(f"--resume continues the run with its own settings; leave out {', '.join(others)}")
    summary = _validate_and_execute(signals, lambda: runner.validate_resume(run_dir))
    print_summary(summary)
    sys.exit(_exit_code(summary))


def _validate_and_execute(
    signals: _SignalsBeforeTheRun,
    validate: Callable[[], Any],
    warnings: tuple[str, ...] | list[str] = (),
) -> dict[str, Any]:
    """Validate (nothing created before it passes), print `warnings` and the config's own (which need a valid
    config), re-exec without root, run with progress: the summary."""
    from harness.run import runner

    try:
        checked = validate()
    except KeyboardInterrupt:  # from work validation does in a child process (harness/process.py)
        signals.stop_if_received()
        raise
    config = checked.config
    if checked.resume_step is not None:
        print_text(f"resuming {checked.folder.final} from its checkpoint at step {checked.resume_step}")
    print_warnings([*warnings, *config.warnings()])
    signals.stop_if_received()
    reexec_if_unprivileged()
    progress = _RunProgress()
    signals.stop_if_received()
    with progress:
        summary = runner.execute(checked, on_progress=progress.update)
        progress.finish(summary.get("steps"), config.train.steps)
    signals.ignore()
    return summary


@click.command("reproduce", cls=_RecordsSignals)
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@out_option
@click.pass_context
def reproduce(ctx, run_dir, out):
    """Rerun a finished run from its folder and print its stored and new figures side by side."""
    from harness.run import runner
    from harness.run.reproduce import figures, prepare

    signals = ctx.meta[_SignalsBeforeTheRun]
    reproduction = prepare(run_dir)
    config = reproduction.config
    summary = _validate_and_execute(signals, lambda: runner.validate(config, out), reproduction.warnings)
    if summary["status"] != "ok":
        print_summary(summary)
        sys.exit(_exit_code(summary))
    table = Table(box=None, pad_edge=False)
    for column in ("figure", f"stored ({run_dir})", f"rerun ({summary['results_dir']})", ""):
        table.add_column(column, overflow="fold")
    for row in figures(reproduction, summary, Path(summary["results_dir"])):
        table.add_row(Text(row.name, style="bold"), Text(row.stored), Text(row.new), Text(row.verdict))
    console.print(table)


@click.command("calibrate", cls=_RecordsSignals)
@profile_option
@clusters_option()
@out_option
@backend_option()
@link_emulator_option()
@click.pass_context
def calibrate(ctx, profile, clusters, out, backend, link_emulator):
    """Measure all-reduce bus bandwidth across the clusters on the shaped link."""
    from harness.run import runner

    signals = ctx.meta[_SignalsBeforeTheRun]
    config = RunConfig.build(
        "allreduce", profile, clusters=clusters, backend=backend, link_emulator=link_emulator, mode="calibrate",
        calibrate=True,
    )  # fmt: skip
    checked = runner.validate(config, out)
    signals.stop_if_received()
    reexec_if_unprivileged()
    signals.stop_if_received()
    summary = runner.execute(checked)
    signals.ignore()
    if summary["status"] != "ok":
        errors.print(
            f"error: calibration failed: {summary['failure']} (results: {summary['results_dir']})",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(1)
    for line in calibration_lines(summary):
        print_text(line)
    print_text(f"results: {summary['results_dir']}")


def calibration_lines(summary: dict[str, Any]) -> list[str]:
    """What `harness calibrate` measured: the ring and single streams against the rate, TCP's retransmits, the
    queue, and the round trip idle and behind full queues."""
    rate = summary["link_rate_bps"]

    def share(bps: float | None) -> str:
        if bps is None:
            return "n/a"
        return f"{format_rate(bps)}" + (f" = {bps / rate:.3f} of the rate" if rate else "")

    def fraction(value: float | None) -> str:
        return "unknown" if value is None else f"{value:.2%}"

    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3g} ms"

    queue = summary.get("link_queue_bytes")
    queue_text = f"{queue // 1024} KiB ({summary['link_queue_delay_ms']:.0f} ms at the rate)" if queue else "none"
    return [
        f"profile {summary['profile']}: {format_rate(rate) if rate else 'unshaped'}, queue {queue_text}, "
        f"{summary['clusters']} clusters",
        f"  ring all-reduce   busbw {share(summary['link_busbw_bps'])}; TCP retransmitted "
        f"{fraction(summary.get('tcp_retransmit_fraction'))} of segments",
        f"  one TCP stream    0->1 {share(summary.get('link_single_stream_bps'))}; TCP retransmitted "
        f"{fraction(summary.get('link_single_stream_retransmit_fraction'))} of segments",
        f"  round trip        idle {ms(summary.get('link_rtt_ms'))}, behind one full queue "
        f"{ms(summary.get('link_loaded_rtt_one_way_ms'))}, both ways full {ms(summary.get('link_loaded_rtt_ms'))}",
    ]


def _on_command_line(ctx: click.Context, name: str) -> bool:
    """Whether the user gave flag `name` (not its default): with --config, only those override the file."""
    return ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE


def _exit_code(summary: dict[str, Any]) -> int:
    """0 ok, 1 failed; a run stopped by a signal exits as the shell expects (128 + N: 130 for Ctrl-C)."""
    if not summary.get("interrupted_by"):
        return 0 if summary["status"] == "ok" else 1
    return 128 + signal.Signals[summary["interrupted_by"]].value


class _RunProgress:
    """A run's progress: a live bar on a terminal; in a log (not a terminal), where a bar's redraws would garble,
    one plain line per evaluation. Either way the last line shown is the run's last step, not the last poll."""

    def __init__(self) -> None:
        self.bars = progress_bars()
        self.live = console.is_terminal
        self.task = self.bars.add_task("starting", total=None, status="building cluster...")
        self.last_val_step: int | None = None

    def __enter__(self) -> _RunProgress:
        self.bars.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bars.__exit__(*exc)

    def update(self, state: dict[str, Any]) -> None:
        if "step" not in state:
            return
        description, status = self._describe(state)
        if self.live:
            self.bars.update(
                self.task, description=description, completed=state["step"] + 1, total=state["total_steps"],
                status=status,
            )  # fmt: skip
        elif state.get("val_step") is not None and state["val_step"] != self.last_val_step:
            self.last_val_step = state["val_step"]
            print_text(f"{description}  {status}")

    def finish(self, steps: int | None, total_steps: int) -> None:
        """The bar at the run's own last step: the last poll may be seconds before it."""
        if self.live and steps:
            self.bars.update(self.task, description=f"step {steps}/{total_steps}", completed=steps, total=total_steps)

    @staticmethod
    def _describe(state: dict[str, Any]) -> tuple[str, str]:
        parts = [f"loss {state['loss']:.3f}" if "loss" in state else ""]
        if "val_loss" in state:
            parts.append(
                f"val {state['val_loss']:.3f}" + (f" (at step {state['val_step']})" if "val_step" in state else "")
            )
        if state.get("step_s"):
            parts.append(f"{state['tokens'] / max(state['step'] + 1, 1) / state['step_s']:,.0f} tok/s")
        util = state.get("link_utilisation")
        parts.append(
            f"link {format_rate(state['link_bps'])}" + (f" ({util:.0%} of {state['link']})" if util is not None else "")
        )
        return f"step {state['step'] + 1}/{state['total_steps']}", "  ".join(parts)


def print_summary(summary: dict[str, Any], same_setup: tuple[str, ...] = ()) -> None:
    table = Table(show_header=False, box=None, pad_edge=False)
    for key, value in _summary_rows(summary):
        # Text, not markup: a failure holds the worker's error, e.g. gloo's "[/path/pair.cc:339] ...".
        table.add_row(Text(key, style="bold"), Text(value))
    console.print(table)
    print_text(f"results: {summary['results_dir']}")
    if summary["status"] == "ok":
        print_text("compare: " + compare_command(summary, same_setup))


def compare_command(summary: dict[str, Any], same_setup: tuple[str, ...] = ()) -> str:
    """The `harness compare` that measures this run's method against allreduce on its link, over three seeds (one
    run is n=1: no spread, and no baseline to say what its figures are worth), with `same_setup`: the run's own
    options that compare takes too (model, data, tokenizer, cluster shape, --set), so it compares this set-up."""
    methods = ",".join(dict.fromkeys(["allreduce", summary["method"]]))
    profile = summary["profile"]
    start = ["harness", "compare", "--profile", profile, "--methods", methods, "--seeds", "0,1,2"]
    return shlex.join([*start, *same_setup, "--out", f"results/compare-{profile}"])


def _same_setup(ctx: click.Context, given: dict[str, Any], assignments: tuple[str, ...]) -> tuple[str, ...]:
    """The options of this run that `harness compare` also takes, as it takes them."""
    from harness.cli.compare import compare

    taken = {param.name: param for param in compare.params if isinstance(param, click.Option)}
    words: list[str] = []
    for name, value in given.items():
        param = taken.get(name)
        if param is None or name in ("out", "seeds") or not _on_command_line(ctx, name):
            continue
        if param.is_flag:
            words += [param.opts[0]] if value else []
        else:
            words += [param.opts[0], str(value)]
    return (*words, *(word for assignment in assignments for word in ("--set", assignment)))


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [
        ("status", summary["status"] + (f" - {summary['failure']}" if summary.get("failure") else "")),
        (
            "method / profile",
            f"{summary['method']} on {summary['profile']} "
            f"({_count(summary['clusters'], 'cluster')} x {_count(summary['stages'], 'stage')}, {summary['backend']})",
        ),
        ("model", f"{summary['model']} ({summary['param_count'] / 1e6:,.2f}M parameters)"),
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
    if summary.get("resumed_at_steps"):
        steps = ", ".join(str(step) for step in summary["resumed_at_steps"])
        rows.append(("resumed", f"at step {steps} (throughput: the steps since the last resume)"))
    rows += _link_rows(summary)
    for fault in summary.get("faults") or []:
        restored = (
            f", restored after {fault['restored_t'] - fault['injected_t']:.1f} s" if "restored_t" in fault else ""
        )
        rows.append(("fault", f"{fault['fault']} injected at step {fault['injected_at_step']}{restored}"))
    rows += _fault_tolerance_rows(summary)
    if summary.get("link_busbw_bps"):
        rows.append(
            (
                "link busbw",
                f"{format_rate(summary['link_busbw_bps'])} measured vs "
                f"{format_rate(summary['link_rate_bps'])} configured",
            )
        )
    return rows


def _fault_tolerance_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Under fault tolerance: each heal, the rounds trained again, goodput."""
    if not summary.get("fault_tolerance"):
        return []
    rows = []
    for heal in summary["heals"]:
        if heal["healed_to_step"] is None:
            rows.append(("heal", f"rank {heal['rank']} killed at step {heal['killed_at_step']}: not healed"))
            continue
        rows.append(
            (
                "heal",
                f"rank {heal['rank']} killed at step {heal['killed_at_step']}: down {heal['down_s']:.1f} s, healed "
                f"{heal['heal_s']:.1f} s after its restart to step {heal['healed_to_step']}, "
                f"{heal['heal_received_bytes']:,} bytes received for a {heal['heal_state_bytes']:,}-byte state",
            )
        )
    applied = summary.get("ft_applied_fraction")
    rows.append(
        (
            "goodput",
            (f"{summary['goodput_tokens_per_s']:,.0f} tokens/s over the wall time" if applied is not None else "-")
            + (f" ({applied:.1%} of the replicas' steps applied)" if applied is not None else "")
            + f"; {summary['rounds_discarded']} round(s) discarded ({summary['steps_discarded']} steps trained again)",
        )
    )
    return rows


def _link_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """What the link did: its conformance to the rate and, for delay/jitter/loss profiles, the probe's figures."""
    rows = []
    if summary.get("link_max_excess") is not None:
        verdict = "conforms" if summary["link_conforms"] else "BROKE the rate"
        retransmits = summary.get("tcp_retransmit_fraction")
        retransmitted = "unknown" if retransmits is None else f"{retransmits:.1%} of segments"
        rows.append(
            (
                "link",
                f"{verdict}: worst window {summary['link_max_excess']:.2f} x (rate x window + burst); "
                f"TCP retransmitted {retransmitted}",
            )
        )
    if summary.get("link_rtt_ms") is not None:
        verdict = "matches the profile" if summary["link_check_ok"] else "MISSES the profile"
        loss = summary.get("link_loss_measured")
        rows.append(
            (
                "link delay",
                f"{verdict} ({summary['link_emulator']}): RTT {summary['link_rtt_ms']:.2f} ms median"
                f"{_floor(summary)} vs "
                f"{summary['link_rtt_target_ms']:g} ms, loss {loss:.2%} vs {summary['link_loss_target']:.2%} "
                f"({summary['link_probes']:,} probes)"
                if loss is not None
                else f"{verdict}: RTT {summary['link_rtt_ms']:.2f} ms vs {summary['link_rtt_target_ms']:g} ms",
            )
        )
    return rows


def _floor(summary: dict[str, Any]) -> str:
    """The fastest echo, beside the median: when the median misses and the floor holds, the host was late, not the
    link (a loaded host delays the delay line; runs from before the floor was recorded have none)."""
    floor = summary.get("link_rtt_min_ms")
    return "" if floor is None else f" (fastest {floor:.2f})"


def _loss_line(summary: dict[str, Any]) -> str:
    """Whatever losses exist: a failed run may have no final training loss but a validation curve."""
    parts = []
    if summary.get("final_train_loss") is not None:
        parts.append(f"train {summary['final_train_loss']:.3f}")
    if summary.get("final_val_loss") is not None:
        parts.append(f"val {summary['initial_val_loss']:.3f} -> {summary['final_val_loss']:.3f}")
    if summary.get("final_val_bpb") is not None:
        parts.append(f"{summary['final_val_bpb']:.3f} bits/byte")
    return ", ".join(parts) or "-"


def _applied(summary: dict[str, Any]) -> str:
    """Applied tokens: those whose updates are in the final synchronized parameters (docs/measurement.md)."""
    applied = summary.get("applied_tokens")
    return "-" if applied is None else f"{applied:,} applied"
