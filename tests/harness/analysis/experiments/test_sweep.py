"""Sweeps run (harness/analysis/experiments/sweep.py; their plan: tests/harness/analysis/test_plan.py): the link
checked before the first run, resuming, failures, the lock, the regime profile; and one real sweep of two methods,
then its report."""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil

import pandas as pd
import pytest
from click.testing import CliRunner

from harness import cli
from harness.analysis.experiments import regime as regime_module
from harness.analysis.experiments.regime import regime_profile
from harness.analysis.experiments.sweep import SweepInterrupted, run_sweep, validate_sweep
from harness.analysis.plan import SweepError, SweepSpec
from harness.analysis.projection.regime import TARGETS, Probe, Regime
from harness.analysis.report.aggregates import comparison
from harness.analysis.report.results import report_markdown
from harness.analysis.report.tables import load_runs
from harness.lock import RunLock
from harness.net.profiles import load_profile
from harness.run import runner
from harness.run.folder import RunFolder
from harness.run.host_cpu import HOST_BUSY_SHARE
from harness.userns import user_namespaces_work
from tests.harness.fakeruns import damage, write_run


def test_a_sweep_whose_delay_line_cannot_open_tun_is_refused_before_it_starts(monkeypatch):
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if os.fspath(path) == "/dev/net/tun":
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(runner, "probe_qdiscs", lambda userns: {"tbf": True, "netem": False})
    spec = SweepSpec(("allreduce",), ("wan-1gbps-40ms-rtt",), (0,), settings={"steps": 20})
    with pytest.raises(SweepError, match="allreduce-wan-1gbps-40ms-rtt-s0: the userspace delay line needs to open"):
        validate_sweep(spec)


@pytest.fixture
def fake_runner(monkeypatch):
    """harness.run.runner.run replaced by one that writes a finished fake run (or fails as told); records its calls."""
    calls: list[str] = []
    fail: dict[str, str] = {}

    def fake_run(config, out, on_progress=None):
        calls.append(out.name)
        if out.name in fail:
            raise runner.RunError(fail[out.name])
        write_run(out.parent, out.name, config.method, config.profile.name, config.train.seed)
        return {**json.loads((out / "summary.json").read_text()), "results_dir": str(out)}

    monkeypatch.setattr(runner, "run", fake_run)
    return calls, fail


def test_resume_skips_finished_runs_and_redoes_interrupted_and_failed_ones(tmp_path, fake_runner):
    calls, fail = fake_runner
    spec = SweepSpec(("allreduce", "local"), ("1gbps", "100mbps"), (0,), settings={"steps": 20})
    out = tmp_path / "sweep"
    fail["local-100mbps-s0"] = "profile needs netem"
    rows = run_sweep(spec, out, command="harness sweep --methods allreduce,local --profiles 1gbps,100mbps")
    assert calls == ["allreduce-1gbps-s0", "local-1gbps-s0", "allreduce-100mbps-s0", "local-100mbps-s0"]
    assert [r.status for r in rows] == ["ok", "ok", "ok", "failed"]
    # An interrupted run leaves only a staging folder; a finished run's folder is complete.
    (out / "runs" / "allreduce-100mbps-s0").rename(out / "runs" / ".allreduce-100mbps-s0.partial")
    del fail["local-100mbps-s0"]
    calls.clear()
    rows = run_sweep(spec, out)
    assert calls == ["allreduce-100mbps-s0", "local-100mbps-s0"]
    assert [r.skipped for r in rows] == [True, True, False, False]
    assert not (out / "runs" / ".allreduce-100mbps-s0.partial").exists()
    index = pd.read_csv(out / "index.csv")
    assert list(index["status"]) == ["ok"] * 4
    assert list(index["path"]) == [f"runs/{c.name}" for c in spec.combinations()]
    calls.clear()
    run_sweep(spec, out, force=True)
    assert len(calls) == 4


def test_the_seeds_that_chose_settings_are_recorded_and_label_the_report(tmp_path, fake_runner):
    """--selected-on goes to sweep.json (a resumed sweep records its latest command's), and `harness report` labels
    the method's runs on those seeds in-sample, only those."""
    spec = SweepSpec(("allreduce", "local"), ("1gbps",), (0, 1), settings={"steps": 20}, selected_on={"local": (1, 5)})
    out = tmp_path / "sweep"
    run_sweep(spec, out)
    assert json.loads((out / "sweep.json").read_text())["selected_on"] == {"local": [1, 5]}
    table = comparison(load_runs([out])).set_index("method")
    assert table.loc["local", "in_sample_seeds"] == "1" and table.loc["allreduce", "in_sample_seeds"] == ""
    run_sweep(SweepSpec(("allreduce", "local"), ("1gbps",), (0, 1), settings={"steps": 20}), out)
    assert json.loads((out / "sweep.json").read_text())["selected_on"] == {}
    with pytest.raises(SweepError, match="--selected-on names dilocox, which --methods does not run"):
        SweepSpec(("allreduce",), ("1gbps",), (0,), selected_on={"dilocox": (0,)}).validate()


def test_an_interrupted_run_that_left_a_checkpoint_is_continued_from_it_not_redone(tmp_path, fake_runner, monkeypatch):
    calls, fail = fake_runner
    spec = SweepSpec(("allreduce", "local"), ("1gbps",), (0,), settings={"steps": 20, "checkpoint_every": 5})
    out = tmp_path / "sweep"
    fail["local-1gbps-s0"] = "rank 1 was killed"
    run_sweep(spec, out)
    # What the failed run left: its folder with a checkpoint every rank completed (as trainers/checkpoint.py writes).
    failed = out / "runs" / "local-1gbps-s0"
    write_run(out / "runs", "local-1gbps-s0", "local", failure="rank 1 was killed")
    complete = failed / "checkpoints" / "step-000010" / "complete"
    complete.parent.mkdir(parents=True)
    complete.touch()
    resumed = []

    def validate_resume(run_dir):
        resumed.append(run_dir)
        return "checked"

    def execute(checked, on_progress=None):
        assert checked == "checked"
        return {**json.loads((failed / "summary.json").read_text()), "status": "ok", "failure": None}

    monkeypatch.setattr(runner, "validate_resume", validate_resume)
    monkeypatch.setattr(runner, "execute", execute)
    calls.clear()
    rows = run_sweep(spec, out)
    # Continued in its folder, which is still there; the finished run is skipped; nothing started from scratch.
    assert resumed == [failed] and calls == [] and complete.exists()
    assert [r.status for r in rows] == ["ok", "ok"]


def test_checkpoint_every_is_a_setting_sweeps_take():
    spec = SweepSpec(("allreduce",), ("1gbps",), (0,), settings={"steps": 20, "checkpoint_every": 5})
    (combo,) = spec.combinations()
    assert spec.config(combo).checkpoint_every == 5


def test_resume_refuses_a_finished_run_whose_options_differ_from_what_it_would_run(tmp_path, fake_runner):
    """As after a default changed: the finished run's recorded options, defaults included, are not this sweep's."""
    calls, _ = fake_runner
    spec = SweepSpec(("allreduce", "opendiloco"), ("1gbps",), (0,), settings={"steps": 20})
    out = tmp_path / "sweep"
    run_sweep(spec, out)
    summary_path = out / "runs" / "opendiloco-1gbps-s0" / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary_path.write_text(json.dumps({**summary, "method_options": {**summary["method_options"], "outer_lr": 0.5}}))
    calls.clear()
    with pytest.raises(SweepError, match=r"ran opendiloco with outer_lr=0.5 where this sweep would run outer_lr=0.7 "
                       r".*pass another --out, or --force to redo the sweep"):  # fmt: skip
        run_sweep(spec, out)
    # A folder from before runs recorded resolved options cannot say what it ran.
    old = {k: v for k, v in summary.items() if k != "method_options_given"}
    summary_path.write_text(json.dumps({**old, "method_options": {}}))
    with pytest.raises(SweepError, match="recorded only the options it was given"):
        run_sweep(spec, out)
    assert calls == []
    run_sweep(spec, out, force=True)
    assert calls == ["allreduce-1gbps-s0", "opendiloco-1gbps-s0"]
    run_sweep(spec, out)


@pytest.mark.parametrize("how", ["truncated", "binary", "list-shaped"])
def test_a_run_whose_summary_is_damaged_is_run_again(tmp_path, fake_runner, how):
    calls, _ = fake_runner
    spec = SweepSpec(("allreduce", "local"), ("1gbps",), (0,), settings={"steps": 20})
    run_sweep(spec, tmp_path / "sweep")
    damage(tmp_path / "sweep" / "runs" / "local-1gbps-s0" / "summary.json", how)
    calls.clear()
    rows = run_sweep(spec, tmp_path / "sweep")
    assert calls == ["local-1gbps-s0"] and [r.skipped for r in rows] == [True, False]


def test_sweep_json_holds_the_command_that_makes_the_sweep(tmp_path, fake_runner, monkeypatch):
    spec = SweepSpec(("allreduce",), ("1gbps",), (0,), settings={"steps": 20})
    run_sweep(spec, tmp_path / "api")
    recorded = json.loads((tmp_path / "api" / "sweep.json").read_text())
    assert recorded == {"settings": {"steps": 20, "per_method": {}}, "command": None, "selected_on": {}}
    # From the command line: the exact command, quoted so it can be pasted back.
    monkeypatch.setattr("harness.cli.sweep.reexec_if_unprivileged", lambda: None)
    out = tmp_path / "my sweep"
    argv = [
        "sweep",
        "--methods",
        "allreduce,local",
        "--profiles",
        "1gbps",
        "--steps",
        "20",
        "--selected-on",
        "local=0,3",
    ]
    argv += ["--out", str(out)]
    monkeypatch.setattr("sys.argv", ["/usr/bin/harness", *argv])
    result = CliRunner().invoke(cli.main, argv)
    assert result.exit_code == 0, result.output
    recorded = json.loads((out / "sweep.json").read_text())
    assert recorded["command"] == (
        f"harness sweep --methods allreduce,local --profiles 1gbps --steps 20 --selected-on local=0,3 --out '{out}'"
    )
    assert recorded["settings"]["steps"] == 20 and recorded["selected_on"] == {"local": [0, 3]}


def test_a_run_timed_on_a_busy_host_is_said_as_it_ends_and_when_it_is_skipped(tmp_path, monkeypatch):
    """The progress line names a run whose summary puts other processes over HOST_BUSY_SHARE of the CPU, with its
    share, as it finishes and again when a resumed sweep skips it; a run at or under the share is not named."""
    shares = {"allreduce-1gbps-s0": 0.23, "local-1gbps-s0": HOST_BUSY_SHARE}

    def fake_run(config, out, on_progress=None):
        write_run(out.parent, out.name, config.method, config.profile.name, config.train.seed)
        summary = {**json.loads((out / "summary.json").read_text()), "host_other_cpu_share": shares[out.name]}
        (out / "summary.json").write_text(json.dumps(summary))
        return summary

    monkeypatch.setattr(runner, "run", fake_run)
    monkeypatch.setattr("harness.cli.sweep.reexec_if_unprivileged", lambda: None)
    argv = ["sweep", "--methods", "allreduce,local", "--profiles", "1gbps", "--steps", "20"]
    argv += ["--out", str(tmp_path / "sweep")]
    # Run, then resumed: both runs skipped.
    for said in ("ok ", "skip "):
        result = CliRunner().invoke(cli.main, argv)
        assert result.exit_code == 0, result.output
        lines = [line for line in result.output.splitlines() if line.startswith(said)]
        assert len(lines) == 2, result.output
        assert "host busy: other processes took 23% of its CPU (over 10%" in lines[0], lines[0]
        assert "host busy" not in lines[1], lines[1]


def test_a_failed_run_is_recorded_and_the_sweep_goes_on(tmp_path, fake_runner):
    calls, fail = fake_runner
    fail["allreduce-1gbps-s0"] = "cannot shape"
    rows = run_sweep(SweepSpec(("allreduce",), ("1gbps",), (0, 1), settings={"steps": 20}), tmp_path)
    assert [(r.status, r.failure) for r in rows] == [("failed", "cannot shape"), ("ok", None)]
    index = pd.read_csv(tmp_path / "index.csv")
    assert index.loc[0, "failure"] == "cannot shape" and pd.isna(index.loc[0, "path"])


def test_a_second_sweep_into_the_same_folder_refuses_and_loses_nothing(tmp_path, fake_runner, monkeypatch):
    """It once deleted the first sweep's live staging folder and ran the same combinations over it."""
    calls, _ = fake_runner
    fake = runner.run
    spec = SweepSpec(("allreduce", "local"), ("1gbps",), (0,), settings={"steps": 20})
    out = tmp_path / "sweep"
    refusals: list[str] = []

    def live_run(config, final, on_progress=None):
        if not refusals:
            # The first sweep's first run is live: its staging folder exists and its run lock is held.
            staging = RunFolder(final).staging
            staging.mkdir(parents=True)
            config.save(staging / "config.json")
            with RunLock(config.run_key, staging=staging):
                with pytest.raises(SweepError) as err:
                    run_sweep(spec, out)
                refusals.append(str(err.value))
                assert staging.is_dir()
            shutil.rmtree(staging)
        return fake(config, final, on_progress)

    monkeypatch.setattr(runner, "run", live_run)
    rows = run_sweep(spec, out)
    assert refusals == [
        f"sweep folder {out} is being written by another sweep (pid {os.getpid()}); wait for it or pass another --out"
    ]
    assert calls == ["allreduce-1gbps-s0", "local-1gbps-s0"]
    assert [r.status for r in rows] == ["ok", "ok"]
    index = pd.read_csv(out / "index.csv")
    assert list(index["name"]) == ["allreduce-1gbps-s0", "local-1gbps-s0"] and list(index["status"]) == ["ok"] * 2
    run_sweep(spec, out)  # the lock went with the first sweep
    assert calls == ["allreduce-1gbps-s0", "local-1gbps-s0"]


def test_a_staging_folder_whose_run_lives_is_left_alone(tmp_path, fake_runner):
    calls, _ = fake_runner
    spec = SweepSpec(("allreduce",), ("1gbps",), (0,), settings={"steps": 20})
    out = tmp_path / "sweep"
    staging = out / "runs" / ".allreduce-1gbps-s0.partial"
    staging.mkdir(parents=True)
    config = spec.config(spec.combinations()[0])
    config.save(staging / "config.json")
    with RunLock(config.run_key, staging=staging):
        (row,) = run_sweep(spec, out)
    assert staging.is_dir() and calls == []
    assert row.status == "failed" and f"{staging} is being written by a live run ({config.run_key})" in row.failure


def test_a_live_runs_staging_folder_is_left_alone_before_it_holds_a_config(tmp_path, fake_runner):
    """The runner makes its staging folder under its lock before it writes config.json: the lock names the folder."""
    calls, _ = fake_runner
    spec = SweepSpec(("allreduce",), ("1gbps",), (0,), settings={"steps": 20})
    out = tmp_path / "sweep"
    staging = out / "runs" / ".allreduce-1gbps-s0.partial"
    staging.mkdir(parents=True)
    with RunLock("hx" + secrets.token_hex(3), staging=staging):
        (row,) = run_sweep(spec, out)
    assert staging.is_dir() and calls == []
    assert row.status == "failed" and f"{staging} is being written by a live run;" in row.failure


def test_an_interrupted_run_stops_the_sweep_and_other_settings_refuse_to_resume(tmp_path, monkeypatch):
    def interrupted(config, out, on_progress=None):
        write_run(out.parent, out.name, config.method, failure="interrupted by SIGINT during the run")
        return json.loads((out / "summary.json").read_text())

    monkeypatch.setattr(runner, "run", interrupted)
    spec = SweepSpec(("allreduce", "local"), ("1gbps",), (0,), settings={"steps": 20})
    with pytest.raises(SweepInterrupted):
        run_sweep(spec, tmp_path)
    assert len(pd.read_csv(tmp_path / "index.csv")) == 1
    with pytest.raises(SweepError, match="other settings"):
        run_sweep(SweepSpec(("allreduce",), ("1gbps",), (0,), settings={"steps": 40}), tmp_path)
    # --force once reran these runs beside the others' and left the folder holding both settings.
    with pytest.raises(SweepError, match=r"other settings .* or another --out"):
        run_sweep(SweepSpec(("allreduce",), ("1gbps",), (0,), settings={"steps": 40}), tmp_path, force=True)
    assert len(pd.read_csv(tmp_path / "index.csv")) == 1


def test_an_out_that_is_a_file_is_refused_and_left_alone(tmp_path):
    """It was a FileExistsError traceback."""
    out = tmp_path / "notes.txt"
    out.write_text("mine")
    with pytest.raises(SweepError, match=r"--out .*notes.txt is a file; pass a folder"):
        run_sweep(SweepSpec(("allreduce",), ("1gbps",), (0,), settings={"steps": 20}), out)
    assert out.read_text() == "mine"


def test_regime_rate_follows_the_derivation_and_the_profile_is_reused(tmp_path, monkeypatch):
    target = TARGETS["paper-107b"]
    assert target.comm_to_compute == pytest.approx(3728 / 10.4 - 1)
    regime = Regime(target, "small", clusters=2, param_count=10_000_000, compute_s=0.5, tokens_per_step=4096)
    # P = 2 (n-1)/n * 4 B * N = 40 MB per step; rate = 8 P / (R T_c).
    assert regime.payload_bytes == 40_000_000
    assert regime.rate_bps == round(8 * 40e6 / (target.comm_to_compute * 0.5))
    # On that link AllReduce's step takes (1 + R) T_c: tokens/s falls by the paper's 3728 / 10.4.
    assert (4096 / 0.5) / (4096 / regime.allreduce_step_s) == pytest.approx(3728 / 10.4)
    derived = []
    monkeypatch.setattr(
        regime_module, "derive_regime", lambda name, settings, work, progress: derived.append(work) or regime
    )
    path, fresh = regime_profile("paper-107b", {"model": "small"}, tmp_path, force=False)
    profile = load_profile(str(path))
    assert (profile.name, profile.inter_cluster.rate_bps) == ("paper-107b", regime.rate_bps)
    assert "rate = 8 P / (R T_c)" in path.read_text() and fresh is regime
    assert regime_profile("paper-107b", {}, tmp_path, force=False) == (path, None)
    assert len(derived) == 1


@pytest.mark.e2e
@pytest.mark.skipif(
    os.geteuid() != 0 and not user_namespaces_work(), reason="needs root or user namespaces for network namespaces"
)
def test_real_sweep_of_allreduce_and_local_then_its_report(tmp_path):
    spec = SweepSpec(
        ("allreduce", "local"),
        ("1gbps",),
        (0,),
        settings={"model": "tiny", "steps": 20, "batch_size": 4, "eval_every": 10, "throughput_warmup_steps": 4},
    )
    rows = run_sweep(spec, tmp_path / "sweep")
    assert [(r.combination.name, r.status) for r in rows] == [("allreduce-1gbps-s0", "ok"), ("local-1gbps-s0", "ok")]
    tables = load_runs([tmp_path / "sweep"])
    table = comparison(tables)
    ar, local = (table[table["variant"] == v].iloc[0] for v in ("allreduce", "local"))
    assert local["ratio_to_allreduce"] == pytest.approx(local["tokens_per_s"] / ar["tokens_per_s"])
    assert ar["utilisation"] == pytest.approx(ar["tokens_per_s"] / local["tokens_per_s"])
    # local never synchronizes: nothing but connection set-up crosses the link.
    assert ar["wire_bytes_per_token"] > 1000 > 100 * local["wire_bytes_per_token"]
    assert "| allreduce" in report_markdown(table, tables.runs)
    # A rerun finds both finished and runs nothing.
    assert all(r.skipped for r in run_sweep(spec, tmp_path / "sweep"))


@pytest.mark.parametrize(("allreduce_tokens_per_s", "exit_code"), [(1000 / 358.5, 0), (1000 / 200.0, 1)])
def test_harness_regime_exits_non_zero_when_the_link_it_wrote_missed_the_target(
    allreduce_tokens_per_s, exit_code, tmp_path, monkeypatch
):
    """It printed "NOT within 10%" and exited 0 after 26 minutes: a script could not tell it failed."""
    target = TARGETS["paper-107b"]
    probe = Probe(10**6, 1000.0, allreduce_tokens_per_s)
    derived = Regime(
        target, "tiny", clusters=2, param_count=10**6, compute_s=0.5, tokens_per_step=4096, probes=(probe,)
    )
    monkeypatch.setattr(regime_module, "derive_regime", lambda *args, **kwargs: derived)
    shown = CliRunner().invoke(cli.main, ["regime", "--out", str(tmp_path / "link.yaml")])
    assert shown.exit_code == exit_code, shown.output
    assert ("NOT within 10%" in shown.output) == bool(exit_code)
    assert (tmp_path / "link.yaml").is_file()
