"""`harness sweep` (many runs into one folder) and `harness regime` (a profile as communication-bound as a
published setting)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click
from rich.text import Text

from harness.cli.common import SweepProgress, console, csv_list, print_text, print_warnings, reexec_if_unprivileged
from harness.cli.options import WithSettings, cluster_options, selected_on_option, set_option, train_options
from trainers.registry import method_names


@click.command("sweep", cls=WithSettings)
@click.option(
    "--methods",
    required=True,
    help=f"Comma-separated methods ({', '.join(method_names())}); METHOD@LABEL runs another variant of METHOD "
    "beside it, its settings from --set METHOD@LABEL.KEY=VALUE.",
)
@click.option("--profiles", default="", help="Comma-separated profile names or profile YAML paths.")
@click.option("--seeds", default="0", show_default=True, help="Comma-separated seeds.")
@set_option(
    "A setting (repeatable) for every method that has it, or every run (a training or cluster setting): KEY=VALUE "
    "fixes it, KEY=V1,V2 sweeps it (the product of all swept settings is run), e.g. local_steps=10,50; "
    "METHOD.KEY=VALUE fixes it for one method or variant, e.g. dilocox.rank=32. `harness methods` lists each "
    "method's settings."
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
@selected_on_option("sweep.json")
@cluster_options
@train_options(seed=False)
def sweep(methods, profiles, seeds, assignments, regime, repeats, out, force, selected_on, **flags):
    """Run methods x profiles x seeds (x --set values) one after another into one sweep folder.

    Round-robin: for each seed (and repeat), each profile, every method runs back to back, so machine noise falls
    on all methods alike. A finished combination (summary.json with status ok) is skipped, so rerunning the command
    resumes an interrupted sweep; a failed run is recorded and the sweep goes on. OUT/index.csv lists every run;
    OUT/sweep.json holds the command line that makes the sweep.
    """
    import shlex

    from harness.analysis.experiments.regime import regime_profile
    from harness.analysis.experiments.sweep import SweepInterrupted, run_sweep, validate_sweep
    from harness.analysis.plan import SweepSpec, parse_selected_on, sweep_settings
    from harness.run.settings import parse_assignments, resolve_entries

    listed = resolve_entries(csv_list(methods, option="--methods"))
    fixed, grid, per_method = sweep_settings(parse_assignments(assignments))
    settings = {**{k: v for k, v in flags.items() if v is not None}, **fixed}
    spec = SweepSpec(
        methods=listed,
        profiles=csv_list(profiles, option="--profiles"),
        seeds=csv_list(seeds, int, "--seeds"),
        grid=grid,
        settings=settings,
        per_method=per_method,
        repeats=repeats,
        selected_on=parse_selected_on(selected_on),
    )
    validate_sweep(spec, regime_pending=regime is not None)
    if spec.profiles:
        print_warnings(spec.warnings())
    reexec_if_unprivileged()
    if regime is not None:
        path, derived = regime_profile(regime, settings, out, force, progress=print_text)
        print_text(derived.describe() if derived else f"regime {regime}: reusing {path}")
        spec = dataclasses.replace(spec, profiles=(*spec.profiles, str(path)))
    display = SweepProgress()
    try:
        with display.bars:
            rows = run_sweep(spec, out, force=force, observer=display, command=shlex.join(["harness", *sys.argv[1:]]))
    except SweepInterrupted as err:
        console.print(
            Text.assemble(("sweep interrupted", "yellow"), f" ({err}); run the same command again to resume it")
        )
        sys.exit(130)
    failed = [r for r in rows if r.status != "ok"]
    print_text(
        f"{len(rows) - len(failed)} of {len(rows)} runs ok; index: {out / 'index.csv'}; next: harness report {out}"
    )
    sys.exit(1 if failed else 0)


@click.command("regime")
@click.option("--target", default="paper-107b", show_default=True, help="The published regime to match.")
@click.option(
    "--out", type=click.Path(path_type=Path), help="Profile YAML to write [default: results/profiles/TARGET-MODEL.yaml]"
)
@cluster_options
@train_options(seed=False)
def regime(target, out, **flags):
    """Derive the link rate at which AllReduce is as communication-bound as TARGET, and write it as a profile.

    Measures this machine's compute time per step with a few `local` steps, then
    rate = 8 P / (R T_c): P gradient bytes per step on a cluster's uplink, R = T_comm / T_c of the target.
    Takes the training and cluster flags of `harness sweep`; a method's settings do not change the measurement.
    """
    import tempfile

    from harness.analysis.experiments.regime import check_request, derive_regime
    from harness.analysis.projection.regime import write_regime_profile

    settings = {k: v for k, v in flags.items() if v is not None}
    check_request(target, settings)
    reexec_if_unprivileged()
    with tempfile.TemporaryDirectory(prefix="harness-regime-") as work:
        derived = derive_regime(target, settings, Path(work), progress=print_text)
    path = write_regime_profile(derived, out or Path("results") / "profiles" / f"{target}-{derived.model}.yaml")
    print_text(derived.describe())
    print_text(f"profile: {path} (use it with --profile {path}); measurements: {path.with_suffix('.json')}")
    # Written all the same (its measurements say how far off it is), but the command did not reach its goal.
    sys.exit(0 if derived.converged or not derived.probes else 1)
