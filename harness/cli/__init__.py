"""The `harness` command: parse, call the library, print. No logic lives here.

One module per command group; `main` imports a command's module only when that command runs or prints its help,
and lists the commands from `COMMANDS` alone, so `harness --help` loads click and nothing else. The modules import
heavy ones (torch, pyroute2, pandas) inside the commands that use them.
"""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple, NoReturn

import click


class Entry(NamedTuple):
    target: str  # "module:attribute" of the click command
    summary: str  # its docstring's first sentence, what `harness --help` lists (a test holds them equal)


COMMANDS = {
    "run": Entry("harness.cli.run:run", "Train one method on the emulated cluster and write a results folder."),
    "reproduce": Entry(
        "harness.cli.run:reproduce",
        "Rerun a finished run from its folder and print its stored and new figures side by side.",
    ),
    "calibrate": Entry(
        "harness.cli.run:calibrate", "Measure all-reduce bus bandwidth across the clusters on the shaped link."
    ),
    "methods": Entry(
        "harness.cli.methods:methods",
        "List the methods, or one method's settings (give them with --set KEY=VALUE or --set METHOD.KEY=VALUE).",
    ),
    "profiles": Entry("harness.cli.profiles:profiles", "Network profiles (netem_profiles/*.yaml)."),
    "doctor": Entry(
        "harness.cli.machine:doctor", "What this machine can do, and which profiles and backends that allows."
    ),
    "cleanup": Entry(
        "harness.cli.machine:cleanup",
        "Remove what a harness killed with SIGKILL left: namespaces, containers, networks, results staging folders.",
    ),
    "bench-cluster": Entry(
        "harness.cli.machine:bench_cluster",
        "Benchmark building and removing the emulated cluster (namespaces, bridge, veths, qdiscs).",
    ),
    "bench-sites": Entry(
        "harness.cli.machine:bench_sites",
        "Benchmark what emulating more sites costs this host: build, teardown, memory, the harness's CPU per step.",
    ),
    "bench-delayline": Entry(
        "harness.cli.machine:bench_delayline",
        "Benchmark the userspace delay line: one TCP stream without it and through it at each RTT.",
    ),
    "sweep": Entry(
        "harness.cli.sweep:sweep",
        "Run methods x profiles x seeds (x --set values) one after another into one sweep folder.",
    ),
    "compare": Entry(
        "harness.cli.compare:compare",
        "Run methods side by side on shaped links and compare their time to a target loss with AllReduce's.",
    ),
    "regime": Entry(
        "harness.cli.sweep:regime",
        "Derive the link rate at which AllReduce is as communication-bound as TARGET, and write it as a profile.",
    ),
    "report": Entry(
        "harness.cli.analysis:report",
        "Compare runs (run folders, sweep folders, or folders of them) as a markdown table per profile.",
    ),
    "plot": Entry(
        "harness.cli.analysis:plot",
        "Loss, throughput and step-time figures (PNG and SVG), one set per profile and model.",
    ),
    "project": Entry(
        "harness.cli.analysis:project",
        "Predict tokens/s and wire bytes per token from measured compute, a link model and the method's schedule.",
    ),
    "check": Entry(
        "harness.cli.analysis:check",
        "Exit 1 when a metric falls outside its band in the baseline; 0 when all hold; 2 on a bad baseline.",
    ),
    "baseline": Entry(
        "harness.cli.analysis:baseline",
        "Write a baseline for `harness check` from RESULTS, a folder of >= 5 repeats (a sweep with --repeats 5).",
    ),
}


class _Group(click.Group):
    """Commands loaded on first use, and the one error path: click's usage errors and the library's UserError (and
    a broken plugin's PluginError) print as one line and exit 2; anything else is a bug and keeps its traceback."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module, _, attribute = COMMANDS[cmd_name].target.partition(":")
        return getattr(importlib.import_module(module), attribute)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Click's own listing, made from the summaries instead of the loaded commands."""
        limit = formatter.width - 6 - max(map(len, COMMANDS))
        stand_ins = [click.Command(name, help=COMMANDS[name].summary) for name in sorted(COMMANDS)]
        rows = [(command.name, command.get_short_help_str(limit)) for command in stand_ins]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def main(self, *args, **kwargs):
        try:
            return super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.Exit as done:
            sys.exit(done.exit_code)
        except click.UsageError as err:
            hint = f" (see harness {err.ctx.info_name} --help)" if err.ctx and err.ctx.parent else ""
            _fail(err.format_message() + hint)
        except click.Abort:
            _fail("aborted")
        except Exception as err:
            # Imported here: harness.errors loads yaml, which `harness --help` does not need.
            from harness.errors import UserError
            from trainers.registry import PluginError

            # PluginError: a method from outside the repository that cannot be used, raised where trainers/ (which
            # must not import harness/) loads it.
            if not isinstance(err, (UserError, PluginError)):
                raise
            _fail(str(err))


def _fail(message: str) -> NoReturn:
    from harness.cli.common import fail

    fail(message)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def main() -> None:
    """Benchmark harness for low-communication LLM training over slow, kernel-shaped links."""
