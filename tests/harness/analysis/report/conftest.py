"""Fixtures shared by the report's tests."""

from tests.harness.analysis.report.reporting import sweep_results  # noqa: F401 (a fixture, found by name)
