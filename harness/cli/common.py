"""What every command prints with, and the steps several commands share."""

from __future__ import annotations

import os
import sys
import typing
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from harness.run.host_cpu import HOST_BUSY_SHARE
from harness.units import format_rate

# Never markup, emoji codes or highlighting: what the harness prints holds paths, names and library messages.
console = Console(markup=False, emoji=False, highlight=False)
errors = Console(stderr=True, markup=False, emoji=False, highlight=False)


def fail(message: str) -> typing.NoReturn:
    """Bad input: one plain line on stderr, exit code 2 (as click's own usage errors)."""
    errors.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    sys.exit(2)


def print_text(text: str) -> None:
    """Untrusted text (paths, names, errors) printed as it is: never read as markup, never highlighted."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def print_warnings(warnings: list[str]) -> None:
    for warning in warnings:
        errors.print(Text.assemble(("warning: ", "yellow"), warning), highlight=False, soft_wrap=True)


def reexec_if_unprivileged() -> None:
    from harness.userns import REEXEC_MARK, die_with_outer_harness, needs_reexec, reexec_in_user_namespace

    if os.environ.get(REEXEC_MARK):
        die_with_outer_harness()
        return
    if needs_reexec():
        sys.exit(reexec_in_user_namespace(sys.argv[1:]))


def csv_list(text: str, kind: type = str, option: str = "") -> tuple:
    """A comma-separated list; one that names an item twice is refused (a repeated seed or method would be run once,
    and a report would count it once, while the command line says twice)."""
    try:
        items = tuple(kind(item.strip()) for item in text.split(",") if item.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r} must be a comma-separated list of {kind.__name__}s") from None
    repeated = [item for i, item in enumerate(items) if item in items[:i]]
    if repeated:
        raise click.UsageError(f"{option or 'the list'} {text} names {repeated[0]} more than once; name each once")
    return items


def progress_bars() -> Progress:
    return Progress(
        # Never markup: descriptions hold run names and profile file names, statuses hold failure text.
        TextColumn("{task.description}", style="bold", markup=False),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[status]}", markup=False),
        TimeElapsedColumn(),
        console=console,
        # Not on a terminal (a log, CI) a bar's redraws garble the file; lines printed beside it still show.
        disable=not console.is_terminal,
    )


def _busy(row) -> Text:
    """Said as each run ends, so that a study's author learns at its first run, not from its report, that the host
    was not quiet (a timed study's runs are void then)."""
    share = row.host_other_cpu_share
    if share is None or share <= HOST_BUSY_SHARE:
        return Text()
    return Text(
        f"  host busy: other processes took {share:.0%} of its CPU (over {HOST_BUSY_SHARE:.0%}: its times are "
        "flagged; remove its folder and run the command again on a quiet host)",
        style="yellow",
    )


class SweepProgress:
    """A bar for the sweep and one for the run in progress; a line per finished run."""

    def __init__(self) -> None:
        self.bars = progress_bars()
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

    def note(self, line: str) -> None:
        """A line of what the command is doing between runs (e.g. deriving a regime link)."""
        self.bars.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def finished(self, row) -> None:
        if self.run is not None:
            self.bars.remove_task(self.run)
            self.run = None
        self.bars.advance(self.sweep)
        speed = f"{row.tokens_per_s:,.0f} tokens/s" if row.tokens_per_s else ""
        if row.skipped:
            line = Text.assemble(("skip", "dim"), f"   {row.combination.name} (finished earlier) {speed}", _busy(row))
        elif row.status == "ok":
            line = Text.assemble(("ok", "green"), f"     {row.combination.name} {speed}", _busy(row))
        else:
            line = Text.assemble(("failed", "red"), f" {row.combination.name}: {row.failure}")
        # One line each, however long, so that a log of a study can be read (and grepped) a run a line.
        self.bars.console.print(line, highlight=False, soft_wrap=True)
