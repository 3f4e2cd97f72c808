"""Fixtures shared by the analysis tests."""

from tests.harness.analysis.repeats import reference  # noqa: F401 (a fixture, found by name)
from tests.harness.analysis.reporting import sweep_results  # noqa: F401 (a fixture, found by name)
