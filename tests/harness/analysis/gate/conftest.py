"""Fixtures shared by the gate's tests."""

from tests.harness.analysis.gate.repeats import reference  # noqa: F401 (a fixture, found by name)
