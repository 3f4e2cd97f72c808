"""A run's config: settings that run but would mislead are warned about, each in one sentence naming the fix."""

from __future__ import annotations

from harness.run.config import RunConfig


def test_one_cluster_is_warned_about_for_every_method_that_exchanges_and_names_its_ignored_settings():
    config = RunConfig.build("dilocox", "1gbps", steps=20, clusters=1, exchange="reduce", rank=8)
    (warning,) = [w for w in config.warnings() if "--clusters 1" in w]
    assert "dilocox never exchanges anything and its settings (exchange=reduce, rank=8) change nothing" in warning
    assert warning.endswith("use --clusters 2 or more")
    assert "its settings" not in next(w for w in RunConfig.build("allreduce", "1gbps", clusters=1).warnings())
    assert not [w for w in RunConfig.build("local", "1gbps", clusters=1).warnings() if "--clusters 1" in w]
    assert not [w for w in RunConfig.build("dilocox", "1gbps", clusters=2).warnings() if "--clusters 1" in w]
