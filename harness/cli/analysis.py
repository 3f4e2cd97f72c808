"""Commands that read results folders or predict without running: report, plot, project, and the CI gate (check,
baseline)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from harness.cli.common import SweepProgress, errors, print_text, reexec_if_unprivileged
from harness.cli.options import (
    LossValue,
    WithSettings,
    clusters_option,
    method_option,
    paths_option,
    profile_option,
    set_option,
)
from trainers.config import TrainConfig

results_argument = click.argument("results", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))


@click.command("report")
@results_argument
@click.option(
    "--target-loss",
    type=LossValue(),
    help="Validation loss for the tokens/time-to-target columns [default: per group, halfway between "
    "allreduce's highest final validation loss and the lowest loss local reached (x 1.05 on allreduce's mean "
    "where local did not run); a group without allreduce needs this option, else those columns are not "
    "computed]. A run that never gets there shows 'not reached'.",
)
@click.option("--csv", "csv_path", type=click.Path(path_type=Path), help="Write the comparison as CSV.")
@click.option("--parquet", "parquet_path", type=click.Path(path_type=Path), help="Write it as parquet (needs pyarrow).")
@click.option(
    "--tables", type=click.Path(path_type=Path), help="Write the tidy runs.csv, events.csv and sites.csv here."
)
@click.option(
    "--tensorboard",
    type=click.Path(path_type=Path),
    help="Write every run's scalars as TensorBoard event files here, a subfolder per run (tensorboard --logdir DIR).",
)
@click.option(
    "--wandb",
    is_flag=True,
    help="Log every run (scalars, config, summary) to Weights & Biases, one W&B run each named by its label "
    "(WANDB_PROJECT, default harness; WANDB_MODE=offline for a later wandb sync).",
)
def report(results, target_loss, csv_path, parquet_path, tables, tensorboard, wandb):
    """Compare runs (run folders, sweep folders, or folders of them) as a markdown table per profile.

    Per method: n (runs aggregated), then each figure as its mean ± the 95% interval (n >= 3), its range (n = 2), or
    "n=1, no spread"; applied (and, where different, trained) tokens/s, ratios to allreduce and local (paired per
    seed where both ran it), compute utilisation (tokens/s over the run's own compute ceiling), wire bytes, final
    validation loss, and tokens and time to the target loss. Where sites differ in rate or there are more than two,
    a per-site table follows: each site's wire bytes and the time its replica waited on the link.
    """
    from harness.analysis.report.aggregates import comparison, site_comparison
    from harness.analysis.report.files import write_csv, write_parquet, write_tables
    from harness.analysis.report.goodput import goodput_markdown, goodput_table
    from harness.analysis.report.results import report_markdown
    from harness.analysis.report.tables import load_runs

    if tensorboard:
        from harness.run.tensorboard import check_log_dir

        check_log_dir(tensorboard)
    if wandb:
        from harness.run.weights_and_biases import check_available

        check_available()
    loaded = load_runs(list(results))
    compared = comparison(loaded, target_loss)
    written = []
    if csv_path:
        written.append(write_csv(compared, csv_path))
    if parquet_path:
        written.append(write_parquet(compared, parquet_path))
    if tables:
        written += write_tables(loaded, tables)
    logged = None
    if tensorboard or wandb:
        from harness.run.folder import find_run_dirs

        # The runs the tables read: a folder they skipped as unreadable is named below, not written.
        readable = set(loaded.runs["path"])
        runs = [(run_dir, label) for run_dir, label in find_run_dirs(list(results)) if label in readable]
        if tensorboard:
            from harness.run.tensorboard import write_runs

            written.append(write_runs(runs, tensorboard))
        if wandb:
            from harness.run.weights_and_biases import log_runs

            logged = log_runs(runs)
    click.echo(report_markdown(compared, loaded.runs, site_comparison(loaded)))
    goodput = goodput_markdown(goodput_table(loaded.runs))
    if goodput:
        click.echo(goodput)
    for path in written:
        print_text(f"wrote {path}")
    if logged:
        print_text(f"logged {logged}")
    _exit_if_skipped(loaded)


def _exit_if_skipped(loaded) -> None:
    """A report over the readable runs stands, but an unreadable one must not pass unnoticed in a script: exit 1."""
    from harness.analysis.report.tables import skipped_note

    if loaded.skipped:
        errors.print(skipped_note(loaded.skipped), markup=False, highlight=False, soft_wrap=True)
        sys.exit(1)


@click.command("project", cls=WithSettings)
@method_option("dilocox")
@set_option(
    "A setting of the method (repeatable), e.g. rank=32 or dilocox.overlap=delayed; `harness methods` lists them."
)
@click.option(
    "--model", default="tiny", show_default=True, help="Any known model, e.g. tiny, small, opt-1.3b, qwen1.5-107b."
)
@profile_option
@clusters_option()
@click.option("--batch-size", type=int, help=f"Sequences per site per step [default: {TrainConfig.batch_size}].")
@click.option("--seq-len", type=int, help="Tokens per sequence [default: the model's context].")
@paths_option(
    "--compute-from",
    "compute_from",
    "Runs (folders of runs) of this method on this machine to measure compute from, scaled by FLOPs to the "
    "model and batch (repeatable).",
    exists=True,
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
@paths_option(
    "--validate",
    "validate_results",
    "Instead: predict every method and profile of these runs, with compute from --compute-from's runs of the "
    "same settings (on an unshaped link), and print predicted vs measured (repeatable).",
    exists=True,
)
@click.option("--csv", "csv_path", type=click.Path(path_type=Path), help="--validate: write the table as CSV.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write the prediction (or table) as JSON.")
def project(
    method, model, profile, clusters, batch_size, seq_len, compute_from, compute_s, accelerator_tflops,
    accelerators_per_site, mfu, efficiency, window_bytes, validate_results, csv_path, json_path, assignments,
):  # fmt: skip
    """Predict tokens/s and wire bytes per token from measured compute, a link model and the method's schedule.

    The model (harness/analysis/projection/link_model.py): a step takes its compute plus the part of each exchange
    that the compute beside it does not hide; an exchange's time is its bytes over min(efficiency x the slowest site's
    rate, TCP window / RTT) plus a round trip per hand-over (gloo's all-reduce hands over two 1 MiB segments at a
    time). Compute comes from --compute-from (this machine, scaled by FLOPs), --compute-s, or a target accelerator
    (--accelerator-tflops, --accelerators-per-site, --mfu).
    """
    from harness.analysis.projection import project as project_model
    from harness.run.config import resolve_method
    from harness.run.settings import parse_assignments, run_settings

    if csv_path and not validate_results:
        raise click.UsageError("--csv writes --validate's table; without --validate, write the prediction with --json")
    if validate_results:
        if not compute_from:
            raise click.UsageError("--validate needs --compute-from: runs of the same settings on an unshaped link")
        _print_validation(project_model.validate(list(validate_results), list(compute_from)), csv_path, json_path)
        return
    accelerator = None
    if accelerator_tflops is not None or accelerators_per_site is not None or mfu is not None:
        if None in (accelerator_tflops, accelerators_per_site, mfu):
            raise click.UsageError("--accelerator-tflops, --accelerators-per-site and --mfu go together")
        accelerator = project_model.Accelerator(accelerator_tflops, accelerators_per_site, mfu)
    method = resolve_method(method)
    settings = {"batch_size": batch_size, "seq_len": seq_len, **run_settings(method, parse_assignments(assignments))}
    prediction = project_model.project(
        method, model, profile, clusters, settings, list(compute_from), compute_s, accelerator,
        project_model.DEFAULT_EFFICIENCY if efficiency is None else efficiency, window_bytes,
    )  # fmt: skip
    for line in prediction.describe():
        print_text(line)
    print_text("assumptions: " + "; ".join(project_model.ASSUMPTIONS))
    if json_path:
        Path(json_path).write_text(json.dumps(prediction.record(), indent=2) + "\n")
        print_text(f"wrote {json_path}")


def _print_validation(rows: list[dict], csv_path: Path | None, json_path: Path | None) -> None:
    """`project --validate`: predicted vs measured per model, profile and method, and the largest error."""
    from harness.analysis.projection import project as project_model
    from harness.analysis.report.markdown import markdown_table

    # The options that tell the rows apart (an exchange, a rank), as KEY=VALUE.
    options = [json.loads(r["options"]) for r in rows]
    varied = sorted({k for o in options for k in o if len({json.dumps(p.get(k)) for p in options}) > 1})
    header = ["model", "profile", "sites", "method", "options", "n", "measured tokens/s", "predicted", "error"]
    header += ["own compute", "predicted from it", "error", "link share"]
    cells = [
        [r["model"], r["profile"], str(r["clusters"]), r["method"],
         ", ".join(f"{k}={o.get(k)}" for k in varied) or "-", str(r["n"]),
         f"{r['measured_tokens_per_s']:,.0f} ({r['measured_min']:,.0f}-{r['measured_max']:,.0f})",
         f"{r['predicted_tokens_per_s']:,.0f}", f"{r['error']:+.1%}", f"{r['own_compute_step_s']:.3f} s",
         f"{r['own_predicted_tokens_per_s']:,.0f}", f"{r['own_error']:+.1%}", f"{r['link_share']:.0%}"]
        for r, o in zip(rows, options, strict=True)
    ]  # fmt: skip
    click.echo(markdown_table(header, cells, text_columns=5))
    tolerance = project_model.VALIDATION_TOLERANCE
    for error, what in (("error", "compute from the other runs"), ("own_error", "each row's own compute")):
        worst = max(rows, key=lambda r: abs(r[error]))
        within = sum(abs(r[error]) <= tolerance for r in rows)
        click.echo(
            f"\n{what}: {within} of {len(rows)} within {tolerance:.0%}; largest error {worst[error]:+.1%} "
            f"({worst['method']} on {worst['profile']}, {worst['clusters']} sites, model {worst['model']})"
        )
    if csv_path:
        import pandas as pd

        from harness.analysis.report.files import write_csv

        print_text(f"wrote {write_csv(pd.DataFrame(rows), csv_path)}")
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2) + "\n")
        print_text(f"wrote {json_path}")


@click.command("plot")
@results_argument
@click.option("--out", type=click.Path(path_type=Path), help="Figure folder [default: RESULTS/figures].")
def plot(results, out):
    """Loss, throughput and step-time figures (PNG and SVG), one set per profile and model.

    For a run that replayed a profile's trace, its achieved rate against the trace's over time.
    """
    from harness.analysis.report.figures import plot_all
    from harness.analysis.report.tables import load_runs

    loaded = load_runs(list(results))
    written = plot_all(loaded, out or results[0] / "figures")
    for path in written:
        print_text(f"wrote {path}")
    _exit_if_skipped(loaded)


@click.command("check")
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
@click.option(
    "--reference-results",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="With --results: the reference code's runs on the same machine [default: RESULTS/reference-code, if there].",
)
@click.option(
    "--stored-references",
    is_flag=True,
    help="Hold every band to the baseline file's references instead of running its reference_code here.",
)
def check(baseline, results, repeats, out, reference_results, stored_references):
    """Exit 1 when a metric falls outside its band in the baseline; 0 when all hold; 2 on a bad baseline.

    Per method and profile, metrics that do not move with the machine's compute speed: step_overhead (a step's own
    time over its forward and backward), step_time_residual (measured over link-model-predicted time, from the
    run's own compute), payload bytes per applied token, wire bytes per payload byte, final validation loss. A band
    holds when reference / (1 + tolerance) <= measured <= reference x (1 + tolerance). Each band that does not hold
    is printed with its likely cause (compute, link, bytes, loss). Where the baseline names reference_code (a git
    commit), the same runs are made with that code on this machine, in turn with this checkout's, and step_overhead
    and step_time_residual (which move with the kind of CPU) are centred on what they measure here.
    """
    import tempfile

    from harness.analysis.experiments.check_runs import run_needed
    from harness.analysis.gate import bands
    from harness.analysis.gate import check as gate

    spec = bands.load_baseline(baseline)
    if reference_results is not None and results is None:
        raise click.UsageError("--reference-results goes with --results (the runs they are paired with)")
    paired_code = None if stored_references else spec.reference_code
    given_results = results is not None
    if results is None:
        reexec_if_unprivileged()
        results = out or Path(tempfile.mkdtemp(prefix="harness-check-"))
        count = repeats or spec.repeats
        beside = f", and with the reference code {paired_code[:12]} into {results / 'reference-code'}"
        print_text(f"running what {baseline} needs ({count} run(s) each) into {results}{beside * bool(paired_code)}")
        display = SweepProgress()
        with display.bars:
            run_needed(spec, results, count, observer=display, reference_code=paired_code)
    if repeats is not None and repeats < spec.repeats:
        print_text(f"note: {repeats} run(s) each, fewer than the {spec.repeats} the bands were derived for")
    reference_dir = None if stored_references else gate.reference_dir_for(results, reference_results)
    if spec.reference_code and reference_dir is None and not stored_references:
        print_text(
            "note: no runs of the baseline's reference code beside these results (--reference-results), so "
            "step_overhead and step_time_residual are held to the stored references, measured on another machine"
        )
    outcomes = gate.check(spec, [results], reference_dir)
    if given_results and all(o.missing and o.missing.startswith("no successful") for o in outcomes):
        # Nothing to hold to the bands: a wrong folder, not a regression.
        raise click.UsageError(
            f"{results} holds no successful run of a method and profile {baseline} checks; pass the folder of the "
            "runs its run: settings make, or leave out --results and `harness check` makes them"
        )
    click.echo(gate.results_table(outcomes))
    on_machine = gate.on_machine_text(outcomes, spec.reference_code)
    if on_machine:
        click.echo(on_machine)
    outside = [o for o in outcomes if not o.ok]
    click.echo(f"{len(outcomes) - len(outside)} of {len(outcomes)} bands hold")
    if outside:
        click.echo(gate.failures_text(outcomes))
    click.echo(f"runs: {results}")
    sys.exit(1 if outside else 0)


@click.command("baseline")
@click.argument("results", required=False, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Baseline YAML to write.")
@click.option(
    "--diff",
    nargs=2,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    metavar="OLD NEW",
    help="Print what changed between two baseline files (settings, checks, every band) instead.",
)
@click.option(
    "--reference-code",
    metavar="COMMIT",
    help="A commit of this repository whose code `harness check` runs beside the checkout on the machine it checks, "
    "to centre step_overhead on what it measures there [default: none; the stored references only].",
)
def baseline(results, out, diff, reference_code):
    """Write a baseline for `harness check` from RESULTS, a folder of >= 5 repeats (a sweep with --repeats 5).

    Every method gets two-sided bands (harness/analysis/gate/check.py's module doc): reference = the median over its
    repeats, tolerance = max(floor, 3.2 x one run's relative standard deviation). RESULTS must hold one
    configuration per method. The file's header holds the one command that regenerates it. With --diff OLD NEW:
    what changed between two baselines.
    """
    if diff:
        if results is not None or out is not None or reference_code is not None:
            raise click.UsageError("--diff OLD NEW compares two files; give it without RESULTS or other options")
        from harness.analysis.gate.baseline_diff import diff_text

        click.echo(diff_text(*diff), nl=False)
        return
    if results is None or out is None:
        raise click.UsageError("give RESULTS and --out FILE (or --diff OLD NEW)")
    from harness.analysis.experiments.reference_code import resolve_commit
    from harness.analysis.gate.baseline import bands_table, write_baseline

    derived = write_baseline(results, out, resolve_commit(reference_code) if reference_code else None)
    click.echo(bands_table(derived.baseline))
    print_text(f"wrote {out}; check with: harness check --baseline {out}")
