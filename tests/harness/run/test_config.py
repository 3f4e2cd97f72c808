"""A run's config: settings that run but would mislead are warned about, each in one sentence naming the fix."""

from __future__ import annotations

import pytest

from harness.run.config import RunConfig


def test_one_cluster_is_warned_about_for_every_method_that_exchanges_and_names_its_ignored_settings():
    config = RunConfig.build("dilocox", "1gbps", steps=20, clusters=1, exchange="reduce", rank=8)
    (warning,) = [w for w in config.warnings() if "--clusters 1" in w]
    assert "dilocox never exchanges anything and its settings (exchange=reduce, rank=8) change nothing" in warning
    assert warning.endswith("use --clusters 2 or more")
    assert "its settings" not in next(w for w in RunConfig.build("allreduce", "1gbps", clusters=1).warnings())
    assert not [w for w in RunConfig.build("local", "1gbps", clusters=1).warnings() if "--clusters 1" in w]
    assert not [w for w in RunConfig.build("dilocox", "1gbps", clusters=2).warnings() if "--clusters 1" in w]


def test_a_run_evaluated_too_rarely_to_read_a_time_to_target_is_warned_about():
    # 100 steps at the default eval_every 50: before training, at 50 and at 100.
    (warning,) = [w for w in RunConfig.build("allreduce", "1gbps", steps=100).warnings() if "--eval-every" in w]
    assert "evaluates the held-out loss only 3 times" in warning and warning.endswith("use --eval-every 25 or less")
    # 110 steps: 0, 50, 100 and the last step; 200 at the default: 5 points, enough.
    assert "only 4 times" in " ".join(RunConfig.build("allreduce", "1gbps", steps=110).warnings())
    assert not [w for w in RunConfig.build("allreduce", "1gbps", steps=200).warnings() if "--eval-every" in w]
    assert not [w for w in RunConfig.build("allreduce", "1gbps", steps=100, eval_every=25).warnings() if "eval" in w]
    # A smoke test of a few steps is not told how to read a curve it does not have.
    assert not [w for w in RunConfig.build("allreduce", "1gbps", steps=20).warnings() if "eval" in w]


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"gpus": "0"}, "--gpus 0 applies to the docker backend"),
        ({"pipeline_schedule": "gpipe"}, "--pipeline-schedule and --microbatches apply to pipeline stages"),
        ({"microbatches": 4}, "--pipeline-schedule and --microbatches apply to pipeline stages"),
        ({"data_field": "body"}, "--data-field body names the text field of JSONL"),
        ({"link_emulator": "netem"}, "asks for no delay, jitter or loss, so no link emulator runs"),
    ],
)
def test_a_setting_this_run_has_no_use_for_is_warned_about(settings, words):
    config = RunConfig.build("local", "unshaped", steps=3, **settings)
    assert any(words in warning for warning in config.warnings()), config.warnings()
    assert not any(words in warning for warning in RunConfig.build("local", "unshaped", steps=3).warnings())
