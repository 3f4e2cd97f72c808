"""This machine: what it can do (doctor), what killed runs left on it (cleanup), how fast it builds clusters and
carries a delay line (bench-cluster, bench-delayline)."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table
from rich.text import Text

from harness.cli.common import console, csv_list, print_text, reexec_if_unprivileged
from harness.cli.options import clusters_option, paths_option, profile_option, stages_option
from harness.units import format_rate


@click.command("doctor")
def doctor() -> None:
    """What this machine can do, and which profiles and backends that allows."""
    from harness.doctor import diagnose

    table = Table("check", "result", "what it means")
    for check in diagnose():
        result = Text.assemble(("yes", "green") if check.ok else ("no", "red"), ": ", check.detail)
        table.add_row(Text(check.name), result, Text(check.meaning))
    console.print(table)


@click.command("cleanup")
@click.option("--run-key", help="Only this run's leftovers (the hx...... prefix in config.json's run_key).")
@paths_option(
    "--results",
    "results_dirs",
    "A folder of results folders whose staging folders (.<name>.partial) to check, one level deep; "
    "repeatable (default: results/runs).",
    file_okay=False,
)
def cleanup(run_key: str | None, results_dirs: tuple[Path, ...]) -> None:
    """Remove what a harness killed with SIGKILL left: namespaces, containers, networks, results staging folders.

    Only runs whose harness is provably dead (its run lock is free) are touched, never a live run's.
    """
    from harness.cleanup import cleanup as cleanup_runs

    report = cleanup_runs(run_key, list(results_dirs) or None)
    # What was removed first: a line saying what was not, printed before it, read as if nothing had been.
    print_text(report.describe())
    for sentence in report.not_checked:
        print_text(sentence)


@click.command("bench-cluster")
@profile_option
@clusters_option()
@stages_option()
@click.option("--repeats", default=10, show_default=True)
def bench_cluster(profile: str, clusters: int, stages: int, repeats: int) -> None:
    """Benchmark building and removing the emulated cluster (namespaces, bridge, veths, qdiscs)."""
    from harness.benchmarks import cluster_lifecycle
    from harness.net.profiles import load_profile

    prof = load_profile(profile)
    reexec_if_unprivileged()
    figures = cluster_lifecycle(prof, clusters, stages, repeats)
    print_text(
        f"{clusters} clusters on {profile}, {repeats} repeats: setup {figures['setup_median_s'] * 1000:.0f} ms, "
        f"teardown {figures['teardown_median_s'] * 1000:.0f} ms, total {figures['total_median_s'] * 1000:.0f} ms "
        f"median ({figures['total_max_s'] * 1000:.0f} ms max)"
    )


@click.command("bench-delayline")
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
    rtts = [float(r) for r in csv_list(rtt_ms, option="--rtt-ms")]
    reexec_if_unprivileged()
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
