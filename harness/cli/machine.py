"""This machine: what it can do (doctor), what killed runs left on it (cleanup), how fast it builds clusters and
carries a delay line (bench-cluster, bench-delayline)."""

from __future__ import annotations

import os
from pathlib import Path

import click
from rich.table import Table
from rich.text import Text

from harness.cli.common import console, csv_list, print_text, print_warnings, reexec_if_unprivileged
from harness.cli.options import clusters_option, paths_option, profile_option, stages_option
from harness.units import format_bytes, format_rate


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

    # Not refused: the rest of the cleanup (namespaces, containers, lock files) does not depend on it.
    unseen = [str(folder) for folder in results_dirs if not os.path.isdir(folder)]
    if unseen:
        print_warnings(
            [f"--results {', '.join(unseen)}: no folder this user can read, so no staging folder there was checked"]
        )
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


@click.command("bench-sites")
@click.option("--sites", default="2,4,8,16,20", show_default=True, help="Comma-separated site counts, one run each.")
@click.option("--method", default="allreduce", show_default=True, help="The method every run trains.")
@profile_option
@click.option("--steps", default=30, show_default=True, type=click.IntRange(min=10), help="Steps per run.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Folder for the runs and the table.")
def bench_sites(sites: str, method: str, profile: str, steps: int, out: Path) -> None:
    """Benchmark what emulating more sites costs this host: build, teardown, memory, the harness's CPU per step.

    One real run of the tiny model per site count: the cluster's build and teardown, every rank's and the harness's
    peak memory, the harness's CPU per step, the step time (OUT/emulation-cost.json)."""
    import json

    from harness.benchmarks import emulation_cost

    counts = csv_list(sites, int, "--sites")
    if any(n < 2 for n in counts):
        raise click.UsageError("--sites counts must be at least 2: one site has no link to emulate")
    if out.exists():
        raise click.UsageError(f"{out} exists; name a new folder with --out")
    reexec_if_unprivileged()
    rows = emulation_cost(counts, method, profile, steps, out)
    (out / "emulation-cost.json").write_text(json.dumps(rows, indent=2) + "\n")
    table = Table("sites", "status", "build", "teardown", "run", "ranks' RSS", "harness RSS", "harness CPU/step",
                  "harness cores", "step", "other CPU")  # fmt: skip
    for r in rows:
        table.add_row(
            str(r["sites"]), r["status"], f"{r['cluster_setup_s'] or 0:.2f} s", f"{r['cluster_teardown_s'] or 0:.2f} s",
            f"{r['run_wall_s']:.1f} s", format_bytes(r["ranks_peak_rss_bytes"]),
            format_bytes(r["harness_peak_rss_bytes"]), f"{r['harness_cpu_s_per_step'] * 1000:.1f} ms",
            f"{r['harness_cores']:.2f}", f"{r['step_s'] * 1000:.0f} ms" if r["step_s"] else "-",
            f"{r['host_other_cpu_share'] or 0:.0%}",
        )  # fmt: skip
    console.print(table)
    print_text(f"wrote {out / 'emulation-cost.json'}")


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
