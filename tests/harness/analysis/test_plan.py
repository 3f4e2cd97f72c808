"""A sweep's plan (harness/analysis/plan.py): settings parsed and routed to the methods that have them, the runs'
names and order, variants of one method side by side, and every refusal before anything runs."""

from __future__ import annotations

import re

import pytest

from harness.analysis.plan import (
    CompareError,
    CompareSpec,
    SweepError,
    SweepSpec,
    build_config,
    fixed_settings,
    sweep_settings,
)
from harness.run.settings import SettingError, parse_assignment, parse_assignments


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


def test_a_setting_no_running_method_reads_is_refused_not_dropped():
    """compare --set exchange=reduce without dilocox once ran, and its notes said "Shared settings: exchange=reduce"."""
    with pytest.raises(
        SweepError, match=r"--set exchange is a setting of dilocox, which --methods \(allreduce, local\)"
    ):
        SweepSpec(("allreduce", "local"), ("1gbps",), (0,), settings={"exchange": "reduce"}).validate()
    with pytest.raises(SweepError, match=r"--set rank is a setting of .*dilocox"):
        SweepSpec(("allreduce",), ("1gbps",), (0,), grid=(("rank", (8, 16)),)).validate()
    # Scoped to a method that does not run: warned about (the gate's sweeps give every method's settings to each
    # group of methods), never dropped unsaid.
    spec = SweepSpec(("allreduce",), ("1gbps",), (0,), settings={"steps": 20}, per_method={"dilocox": {"rank": 8}})
    spec.validate()
    assert spec.warnings()[0] == (
        "--set dilocox.KEY=VALUE (rank) is scoped to dilocox, which --methods (allreduce) does not run, so it changes "
        "nothing; add dilocox to --methods or leave it out"
    )
    compare = CompareSpec(("allreduce", "dilocox"), ("1gbps",), per_method={"dilocox@paper": {"rank": 8}})
    compare.validate()
    assert "scoped to dilocox@paper, which --methods (allreduce, dilocox) does not run" in compare.warnings()[0]
    # One running method that reads it is enough: the others go without (as before).
    SweepSpec(("allreduce", "dilocox"), ("1gbps",), (0,), settings={"exchange": "reduce", "steps": 20}).validate()


def test_a_comparison_on_one_cluster_is_refused_before_it_runs():
    """It ran every run, then ended in a TypeError: one cluster has no link, so no wire bytes to compare."""
    for spec in (
        CompareSpec(("allreduce", "local"), ("1gbps",), settings={"clusters": 1}),
        CompareSpec(("allreduce", "dilocox"), ("1gbps",), per_method={"dilocox": {"clusters": 1}}),
    ):
        with pytest.raises(CompareError, match="--clusters 1 has none .* use --clusters 2 or more"):
            spec.validate()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (CompareSpec(("allreduce",), ()), "name at least one link with --profile (measured) or --composed"),
        (CompareSpec((), ("1gbps",)), "name the methods to compare with --methods; known: "),
        (CompareSpec(("allreduce",), ("1gbps",), target_loss=-1.0), "--target-loss must be a positive validation"),
        (CompareSpec(("allreduce",), ("1gbps",), target_loss=float("nan")), "--target-loss must be a positive"),
        (
            CompareSpec(("allreduce", "dilocox"), ("1gbps",), measure_limit_s=60.0),
            "--measure-limit applies only with --regime",
        ),
        (
            CompareSpec(("allreduce", "dilocox"), ("1gbps",), composed_methods={"100mbps": ("allreduce",)}),
            "a link split between measured and composed methods must be both; 100mbps is not",
        ),
        (
            CompareSpec(("allreduce",), ("1gbps",), method_steps={"dilocox": 100}),
            "--method-steps names dilocox, which --methods does not run",
        ),
        (
            CompareSpec(("allreduce",), ("1gbps",), per_method={"nosuch": {"rank": 2}}),
            "options given for unknown method 'nosuch'",
        ),
    ],
)
def test_each_refusal_of_a_comparison_is_one_sentence_naming_the_fix(spec, message):
    with pytest.raises(CompareError) as err:
        spec.validate()
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (SweepSpec(("allreduce",), (), (0,)), "name at least one profile with --profiles, or use --regime"),
        (SweepSpec((), ("1gbps",), (0,)), "a sweep needs at least one method, one profile and one seed"),
        (SweepSpec(("allreduce",), ("1gbps",), ()), "a sweep needs at least one method, one profile and one seed"),
        (SweepSpec(("allreduce",), ("1gbps",), (0,), repeats=0), "--repeats must be at least 1, got 0"),
    ],
)
def test_each_refusal_of_a_sweep_is_one_sentence(spec, message):
    with pytest.raises(SweepError, match=re.escape(message)):
        spec.validate()


@pytest.mark.parametrize("value", ["soon", "0", "-5", "inf", "nan"])
def test_a_bad_harness_timeout_is_refused_naming_the_variable(value, monkeypatch):
    from harness.errors import UserError
    from harness.run.config import default_collective_timeout_s

    monkeypatch.setenv("HARNESS_TIMEOUT_S", value)
    with pytest.raises(UserError, match=f"HARNESS_TIMEOUT_S='{value}' is not a positive number of seconds"):
        default_collective_timeout_s()
