"""`harness compare`: methods side by side on the same links, seeds and tokens, in time to a target loss."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click
from rich.text import Text

from harness.cli.common import SweepProgress, console, csv_list, print_text, print_warnings, reexec_if_unprivileged
from harness.cli.options import (
    LossValue,
    WithSettings,
    cluster_options,
    selected_on_option,
    set_option,
    train_options,
)
from trainers.registry import method_names


def _profiles(values: tuple[str, ...], option: str) -> tuple[str, ...]:
    """Repeatable options that also take comma-separated lists."""
    return csv_list(",".join(values), option=option)


@click.command("compare", cls=WithSettings)
@click.option(
    "--methods",
    required=True,
    help=f"Comma-separated methods ({', '.join(method_names())}); allreduce sets the default target and the "
    "speed-ups, local the utilisation; METHOD@LABEL runs another variant of METHOD beside it (dilocox@paper, its "
    "settings from --set dilocox@paper.overlap=delayed).",
)
@click.option(
    "--profile", "profiles", multiple=True, help="A link to measure end to end (repeatable; profile name or YAML)."
)
@click.option(
    "--composed",
    multiple=True,
    metavar="PROFILE",
    help="A link to estimate by composition (repeatable): the loss trajectory of a full run on an unshaped link (or "
    "on PROFILE, where --profile measures it too) with the step times of a short trace run on PROFILE. For links "
    "where AllReduce would take too long here; labelled 'composed' wherever it appears.",
)
@click.option(
    "--regime",
    metavar="TARGET",
    help="Derive, when the study starts, a link as communication-bound as TARGET (paper-107b) from local measured "
    "then (OUT/profiles/TARGET.yaml, reused when resumed), and run every method on it: end to end where the link "
    "model predicts the run within --measure-limit here, composed otherwise (AllReduce, typically), each row "
    "labelled.",
)
@click.option(
    "--measure-limit",
    "measure_limit_min",
    type=click.FloatRange(min=0, min_open=True),
    help="With --regime: minutes a run may be predicted to take on its link and still run end to end [default: 30].",
)
@click.option("--seeds", default="0", show_default=True, help="Comma-separated seeds.")
@set_option(
    "A setting (repeatable): KEY=VALUE for every method that has it (or every run: a training or cluster setting), "
    "METHOD.KEY=VALUE for one method or variant, e.g. dilocox.local_steps=20; printed with the table. "
    "`harness methods` lists each method's settings."
)
@click.option(
    "--method-steps",
    multiple=True,
    metavar="METHOD=N",
    help="Train one method for N steps instead of --steps (repeatable); printed with the table, and the loss gap "
    "is then taken at the tokens both reached.",
)
@click.option(
    "--target-loss",
    type=LossValue(),
    help="Validation loss to reach [default: halfway between allreduce's highest final validation loss over its "
    "seeds and the lowest local reached, so no local run reaches it; allreduce's mean final loss x 1.05 with "
    "--no-control]; the only way to compare without allreduce.",
)
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Compare folder (resumed if it exists).")
@click.option("--force", is_flag=True, help="Rerun finished runs.")
@selected_on_option("compare.json")
@click.option(
    "--control/--no-control",
    default=True,
    show_default=True,
    help="Run local beside the methods when --methods leaves it out: the same training with no communication, the "
    "compute floor; a target it reaches is flagged as one that does not measure communication.",
)
@cluster_options
@train_options(seed=False)
def compare(
    methods,
    profiles,
    composed,
    regime,
    measure_limit_min,
    seeds,
    assignments,
    method_steps,
    target_loss,
    out,
    force,
    control,
    selected_on,
    **flags,
):
    """Run methods side by side on shaped links and compare their time to a target loss with AllReduce's.

    Every method trains the same model on the same data with the same seeds to the same steps (so the same applied
    tokens), on each --profile, as one sweep into OUT (OUT/index.csv, OUT/runs/; `harness report OUT` reads it).
    Then, per profile and method: time to the target validation loss, the speed-up over AllReduce in that time with
    its 95% interval (paired per seed), applied tokens/s, utilisation (vs local, where it ran), wire bytes per
    token, final validation loss and the loss gap to AllReduce at equal tokens; each with n and its interval.

    The target defaults to one local, which never communicates, does not reach: halfway between AllReduce's highest
    final validation loss over its seeds and the lowest loss local reached; it is printed with how it was derived.
    A --composed link's times are an estimate, labelled "composed" in the table, the summaries, OUT/compare.csv,
    OUT/compare.json and the figures: a link's trajectory does not depend on its rate, so a full run elsewhere is
    composed with a short trace on that link (OUT/traces/; docs/comparisons.md says how, and when a trace is
    flagged as unsteady). A link given both ways also prints composed vs measured. --regime derives its link when
    the study starts and measures there every method that finishes within --measure-limit. Writes OUT/compare.md,
    OUT/compare.csv, OUT/compare.json, OUT/headline.md (the compact tables, one row per method and link) and
    OUT/figures/; rerunning the command resumes it.
    """
    from harness.analysis.experiments.compare import run_compare, validate_compare
    from harness.analysis.experiments.sweep import SweepInterrupted
    from harness.analysis.plan import CompareSpec, fixed_settings, parse_method_steps, parse_selected_on, with_control
    from harness.analysis.report.compare import compare_markdown, summary_lines
    from harness.analysis.report.compare_files import write_outputs
    from harness.run.settings import parse_assignments, resolve_entries

    listed = resolve_entries(csv_list(methods, option="--methods"))
    settings, per_method = fixed_settings(parse_assignments(assignments), "a comparison")
    spec = CompareSpec(
        methods=with_control(listed) if control else listed,
        profiles=_profiles(profiles, "--profile"),
        composed=_profiles(composed, "--composed"),
        seeds=csv_list(seeds, int, "--seeds"),
        settings={**{k: v for k, v in flags.items() if v is not None}, **settings},
        per_method=per_method,
        method_steps=parse_method_steps(method_steps),
        target_loss=target_loss,
        selected_on=parse_selected_on(selected_on),
        regime=regime,
        measure_limit_s=None if measure_limit_min is None else 60 * measure_limit_min,
    )
    validate_compare(spec)
    print_warnings(spec.warnings())
    reexec_if_unprivileged()
    command = shlex.join(["harness", *sys.argv[1:]])
    display = SweepProgress()
    try:
        with display.bars:
            result = run_compare(spec, out, force=force, observer=display, command=command, progress=display.note)
    except SweepInterrupted as err:
        console.print(
            Text.assemble(("compare interrupted", "yellow"), f" ({err}); run the same command again to resume it")
        )
        sys.exit(130)
    written = write_outputs(result, out, command)
    click.echo(compare_markdown(result, command))
    for line in summary_lines(result):
        print_text(line)
    files = [p.name for p in written if p.parent == out]
    print_text(f"wrote {', '.join(files)} in {out}, and {len(written) - len(files)} figures in {out}/figures")
    # The table stands on the runs that finished; a script must still see that some did not.
    sys.exit(1 if result.failed else 0)
