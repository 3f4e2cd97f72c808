"""Fixtures shared by the harness tests."""

import fcntl
from collections.abc import Iterator

import pytest

from tests.harness.refusal import harness_cli  # noqa: F401 (a fixture, found by name)

# Beside the first phase's other tests (make test), one test at a time uses the Docker engine: the docker tests'
# check that nothing is left compares the engine's namespaces host-wide, which another test's containers would fill.
# (pytest-xdist's --dist loadgroup would say the same, but with pytest 9.2 it silently stops grouping.)
ENGINE_LOCK = "/tmp/harness-tests-docker-engine.lock"


@pytest.fixture
def docker_engine_to_itself() -> Iterator[None]:
    """Holds an exclusive lock for the test's duration; another test asking for it waits."""
    with open(ENGINE_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
