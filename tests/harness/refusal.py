"""In-process CLI runs that must be refused: one line "error: ...", exit 2, and nothing created on the host.

The real run (and the user-namespace re-exec) is replaced by a sentinel, so input that wrongly passes validation
fails the test at once instead of building a cluster. Shared by test_cli_input.py and test_early_validation.py.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

import harness.cli as cli
import harness.run.config
import harness.run.runner as runner
from harness import userns
from harness.cli import common
from tests.harness.hoststate import link_names, netns_names

# The kernel creates ifb0/ifb1 in the host namespace when the ifb module is first loaded (the qdisc probe may do
# that); they are not the run's objects.
KERNEL_MADE = re.compile(r"ifb\d+")
# The run key the tests' runs get (RunConfig draws "hx" + 6 hex digits); objects of other keys belong to harness
# runs that other tests or users may have going at the same time.
TEST_KEY_HEX = "7e57ed"
OTHER_RUN = re.compile(rf"hx(?!{TEST_KEY_HEX})[0-9a-f]{{6}}")


class RunStarted(Exception):
    """Raised by the stand-in for the real run: validation let the input through."""


def host_state(root: Path) -> dict[str, list[str]]:
    """Namespaces and host links (but those of other harness runs), and the files under `root`."""

    def mine(names: set[str]) -> list[str]:
        return sorted(n for n in names if not KERNEL_MADE.fullmatch(n) and not OTHER_RUN.match(n))

    return {
        "netns": mine(netns_names()),
        "links": mine(link_names()),
        "files": sorted(str(p.relative_to(root)) for p in root.rglob("*")),
    }


@pytest.fixture
def harness_cli(tmp_path, monkeypatch):
    """Run `harness ARGS` in tmp_path on a 2-core machine; returns (result, host state before, after)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    for var in ("HARNESS_MAX_RATE", "HARNESS_TIMEOUT_S", userns.REEXEC_MARK):
        monkeypatch.delenv(var, raising=False)
    # What a pipe or a CI log gets, whatever terminal runs the tests.
    monkeypatch.setattr(common.console, "_width", 80)
    monkeypatch.setattr(harness.run.config.secrets, "token_hex", lambda nbytes: TEST_KEY_HEX)

    def started(*args, **kwargs):
        raise RunStarted("validation passed and the run started")

    monkeypatch.setattr(runner, "run", started)
    monkeypatch.setattr(runner, "execute", started)
    monkeypatch.setattr(userns, "reexec_in_user_namespace", started)

    def invoke(args: list[str]) -> tuple[Result, dict, dict]:
        before = host_state(tmp_path)
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            result = CliRunner().invoke(cli.main, args)
        finally:
            # A run that returned leaves them ignored to the end of the process, which here goes on.
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        return result, before, host_state(tmp_path)

    return invoke


def flat(output: str) -> str:
    return " ".join(click.unstyle(output).split())


def lines(output: str) -> list[str]:
    return [line for line in click.unstyle(output).splitlines() if line.strip()]


def assert_refused(result: Result, before: dict, after: dict, expect: list[str], absent: list[str] = ()) -> None:
    shown = f"exit {result.exit_code}, output:\n{result.output}\nexception: {result.exception!r}"
    assert not isinstance(result.exception, RunStarted), f"validation let this through: {shown}"
    assert result.exit_code == 2, shown
    assert isinstance(result.exception, SystemExit), shown
    assert "Traceback" not in result.output
    assert len(lines(result.output)) == 1, f"{len(lines(result.output))} lines:\n{result.output}"
    text = flat(result.output)
    assert text.startswith("error: "), shown
    for fragment in expect:
        assert fragment in text, f"{fragment!r} missing from: {text}"
    for fragment in absent:
        assert fragment not in text, f"{fragment!r} in: {text}"
    assert after == before, "something was created"


def assert_started(result: Result) -> None:
    assert isinstance(result.exception, RunStarted), f"exit {result.exit_code}: {result.output}"
