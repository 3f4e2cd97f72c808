"""Sweeps: the plan, resuming, failures, the regime profile; and one real sweep of two methods, then its report."""

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
from harness.analysis import regime as regime_module
from harness.analysis.comparison import comparison
from harness.analysis.regime import TARGETS, Regime, regime_profile
from harness.analysis.report import markdown
from harness.analysis.sweep import (
    SweepError,
    SweepInterrupted,
    SweepSpec,
    build_config,
    fixed_settings,
    run_sweep,
    sweep_settings,
)
from harness.analysis.tables import load_runs
from harness.lock import RunLock
from harness.net.profiles import load_profile
from harness.run import runner
from harness.run.folder import RunFolder
from harness.run.settings import SettingError, parse_assignment, parse_assignments
from harness.userns import user_namespaces_work
from tests.harness.fakeruns import damage, write_run


def test_set_values_are_parsed_and_method_options_go_only_where_they_apply():
    assert parse_assignment("local_steps=10,50") == (None, "local_steps", (10, 50))
    assert parse_assignment("lr=1e-3,0.01") == (None, "lr", (1e-3, 0.01))
    assert parse_assignment("pseudo-grad-dtype=fp16,bf16") == (None, "pseudo_grad_dtype", ("fp16", "bf16"))
    assert parse_assignment("cocktail.bits=none") == ("cocktail", "bits", ("none",))
    assert parse_assignment("dilocox@paper.overlap=delayed") == ("dilocox@paper", "overlap", ("delayed",))
    for bad in ("local_steps", "=3", ".rank=3", "rank="):
        with pytest.raises(SettingError, match=r"must look like \[METHOD.\]KEY=VALUE"):
            parse_assignment(bad)
    fixed, grid, per_method = sweep_settings(
        parse_assignments(["steps=20", "local_steps=10,50", "dilocox.rank=32", "dilocox@paper.overlap=delayed"])
    )
    assert fixed == {"steps": 20} and grid == (("local_steps", (10, 50)),)
    assert per_method == {"dilocox": {"rank": 32}, "dilocox@paper": {"overlap": "delayed"}}
    with pytest.raises(SweepError, match="gives one method several values; run each as a variant"):
        sweep_settings(parse_assignments(["dilocox.rank=16,32"]))
    with pytest.raises(SweepError, match="gives several values, and a comparison runs one"):
        fixed_settings(parse_assignments(["local_steps=10,50"]), "a comparison")
    spec = SweepSpec(("allreduce", "opendiloco"), ("1gbps",), (0, 1), grid=(("local_steps", (10, 50)),))
    names = [c.name for c in spec.combinations()]
    # allreduce has no local_steps: it runs once per seed, not once per value.
    assert names == [
        "allreduce-1gbps-s0",
        "opendiloco-1gbps-s0-local_steps=10",
        "opendiloco-1gbps-s0-local_steps=50",
        "allreduce-1gbps-s1",
        "opendiloco-1gbps-s1-local_steps=10",
        "opendiloco-1gbps-s1-local_steps=50",
    ]
    assert spec.config(spec.combinations()[0]).method_options == {}
    assert spec.config(spec.combinations()[2]).method_options == {"local_steps": 50}


def test_runs_go_round_robin_seed_and_repeat_outermost_then_profile_then_method():
    spec = SweepSpec(("allreduce", "dilocox", "local"), ("1gbps", "100mbps"), (0, 1), repeats=2)
    names = [c.name for c in spec.combinations()]
    # Each seed's (and repeat's) methods run back to back, so a slow moment of the machine hits every method.
    assert names == [
        f"{method}-{profile}-s{seed}-r{repeat}"
        for seed in (0, 1)
        for repeat in (0, 1)
        for profile in ("1gbps", "100mbps")
        for method in ("allreduce", "dilocox", "local")
    ]
    assert names[:3] == ["allreduce-1gbps-s0-r0", "dilocox-1gbps-s0-r0", "local-1gbps-s0-r0"]
    assert len(set(names)) == 2 * 2 * 2 * 3


def test_settings_are_routed_by_name_and_checked_before_anything_runs():
    config = build_config("opendiloco", "1gbps", 3, {"model": "tiny", "steps": 20, "lr": 1e-3, "stages": 2,
                                                     "local_steps": 5, "bits": 2})  # fmt: skip
    assert (config.train.model, config.train.seed, config.train.optim.lr, config.stages) == ("tiny", 3, 1e-3, 2)
    assert config.method_options == {"local_steps": 5}  # bits is cocktail's, not opendiloco's
    assert config.train.throughput_warmup_steps == 5  # the default fits in 20 steps; as `harness run` keeps it
    assert build_config("allreduce", "1gbps", 0, {"steps": 4}).train.throughput_warmup_steps == 0
    with pytest.raises(SweepError, match="unknown setting"):
        SweepSpec(("allreduce",), ("1gbps",), (0,), settings={"nosuch": 1}).validate()
    with pytest.raises(SweepError, match="opendiloco-1gbps-s0-local_steps=0"):
        SweepSpec(("opendiloco",), ("1gbps",), (0,), grid=(("local_steps", (0,)),)).validate()
    with pytest.raises(SweepError, match="local_steps is not a setting of allreduce"):
        SweepSpec(("allreduce",), ("1gbps",), (0,), per_method={"allreduce": {"local_steps": 3}}).validate()


def test_two_variants_of_one_method_run_side_by_side_each_with_its_own_options():
    spec = SweepSpec(
        ("allreduce", "dilocox", "dilocox@paper"),
        ("1gbps",),
        (0,),
        settings={"local_steps": 10},
        per_method={"dilocox@paper": {"overlap": "delayed", "rank": 32}},
    )
    spec.validate()
    combos = spec.combinations()
    assert [c.name for c in combos] == ["allreduce-1gbps-s0", "dilocox-1gbps-s0", "dilocox@paper-1gbps-s0"]
    default, paper = (spec.config(c) for c in combos[1:])
    assert default.method == paper.method == "dilocox"
    assert (default.resolved_options["overlap"], default.resolved_options["rank"]) == ("streaming", 64)
    assert (paper.resolved_options["overlap"], paper.resolved_options["rank"]) == ("delayed", 32)
    assert default.resolved_options["local_steps"] == paper.resolved_options["local_steps"] == 10
    for methods, refusal in (
        (("dilocox@paper", "nosuch@x"), "unknown method"),
        (("dilocox", "dilocox"), "more than once"),
        (("dilocox@Paper!",), "lower-case letters"),
    ):
        with pytest.raises(SweepError, match=refusal):
            SweepSpec(methods, ("1gbps",), (0,)).validate()
    with pytest.raises(SweepError, match="topk_keep is not a setting of dilocox@paper"):
        SweepSpec(("dilocox@paper",), ("1gbps",), (0,), per_method={"dilocox@paper": {"topk_keep": 0.1}}).validate()


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
        spec.validate()


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
    assert json.loads((tmp_path / "api" / "sweep.json").read_text()) == {"settings": {"steps": 20, "per_method": {}},
                                                                          "command": None}  # fmt: skip
    # From the command line: the exact command, quoted so it can be pasted back.
    monkeypatch.setattr("harness.cli.sweep.reexec_if_unprivileged", lambda: None)
    out = tmp_path / "my sweep"
    argv = ["sweep", "--methods", "allreduce,local", "--profiles", "1gbps", "--steps", "20", "--out", str(out)]
    monkeypatch.setattr("sys.argv", ["/usr/bin/harness", *argv])
    result = CliRunner().invoke(cli.main, argv)
    assert result.exit_code == 0, result.output
    recorded = json.loads((out / "sweep.json").read_text())
    assert recorded["command"] == f"harness sweep --methods allreduce,local --profiles 1gbps --steps 20 --out '{out}'"
    assert recorded["settings"]["steps"] == 20


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
    monkeypatch.setattr(regime_module, "derive_regime", lambda name, settings, work: derived.append(work) or regime)
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
    assert "| allreduce" in markdown(table, tables.runs)
    # A rerun finds both finished and runs nothing.
    assert all(r.skipped for r in run_sweep(spec, tmp_path / "sweep"))
