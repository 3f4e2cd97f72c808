"""Fixtures shared by the harness tests."""

from tests.harness.refusal import harness_cli  # noqa: F401 (a fixture, found by name)
