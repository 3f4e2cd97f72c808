"""`harness cleanup` against real runs: it never touches a live run's namespaces (whatever phase the run is in),
and removes everything a SIGKILLed harness left (namespaces, lock file, results staging folder).

Every cleanup here is given the run key of what the test made: other runs on this host are not the test's to remove.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pyroute2 import netns

import harness
from harness.lock import ROOT_LOCK_DIR, RunLock, owner_alive
from tests.harness.e2e import HARNESS, SMALL_RUN, run_marker, summary_of, wait_for_steps
from tests.harness.e2e import harness as run_harness
from tests.harness.hoststate import leftovers, snapshot, worker_pids

pytestmark = pytest.mark.e2e

if os.geteuid() != 0:
    pytest.skip(
        "cleanup's namespaces live under /run/netns, which only root can create and remove", allow_module_level=True
    )

NOT_WIRED = (
    "harness run holds no run lock: harness/run/runner.py must take RunLock(config.run_key) before it creates anything "
    "(see harness/lock.py)"
)
REPO = Path(harness.__file__).resolve().parent.parent
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def namespaces_of(key: str) -> list[str]:
    return sorted(name for name in snapshot()["netns"] if name.startswith(f"{key}-"))


def cleanup(key: str, *results: Path) -> subprocess.CompletedProcess:
    args = ["cleanup", "--run-key", key]
    for folder in results:
        args += ["--results", folder]
    result = run_harness(*args, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    return result


def staged_key(out: Path, proc: subprocess.Popen, timeout: float = 60) -> str:
    """The run key, as soon as the run has written its staging config.json (before it builds its cluster)."""
    config = out.parent / f".{out.name}.partial" / "config.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            return json.loads(config.read_text())["run_key"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.05)
    raise AssertionError(f"no {config} after {timeout}s")


def own_leftovers(before: dict, out: Path, key: str) -> dict:
    """What the run left on the host: only what carries its key (other tests may run at the same time)."""
    found = leftovers(before, run_marker(out))
    mine = {kind: [n for n in names if kind == "workers" or str(n).startswith(key)] for kind, names in found.items()}
    return {kind: names for kind, names in mine.items() if names}


@pytest.fixture
def start_run():
    """Start `harness run ARGS --out OUT` in the background; at the end, whatever happened, the run is killed and what
    it left is removed (by its run key: nothing else), so that a failed test leaves the host clean."""
    started: list[tuple[subprocess.Popen, Path]] = []

    def start(out: Path, *args: str) -> subprocess.Popen:
        # Its output goes to a file: a pipe nobody reads while the test runs cleanup could fill and stall the run.
        with open(out.parent / f"{out.name}.harness.log", "wb") as log:
            proc = subprocess.Popen([*HARNESS, "run", *args, "--out", str(out)], stdout=log, stderr=subprocess.STDOUT)
        started.append((proc, out))
        return proc

    yield start
    for proc, out in started:
        proc.kill()
        proc.wait()
        for config in (out / "config.json", out.parent / f".{out.name}.partial" / "config.json"):
            if config.exists():
                key = json.loads(config.read_text())["run_key"]
                if namespaces_of(key) or owner_alive(key) is False:
                    run_harness("cleanup", "--run-key", key, timeout=60)


@pytest.fixture
def new_key():
    """A fresh run key for what a test makes by hand; at the end, whatever happened, the namespaces with that key
    and its lock file, once no live process holds it, are removed."""
    keys: list[str] = []

    def make() -> str:
        keys.append("hx" + secrets.token_hex(3))
        return keys[-1]

    yield make
    for key in keys:
        for name in namespaces_of(key):
            netns.remove(name)
        if owner_alive(key) is False:
            (ROOT_LOCK_DIR / f"{key}.lock").unlink(missing_ok=True)


HOLD_AND_BUILD = (
    "import sys, time\n"
    "from pyroute2 import netns\n"
    "from harness.lock import RunLock\n"
    "RunLock(sys.argv[1]).acquire()\n"
    "for name in sys.argv[2:]:\n"
    "    netns.create(name)\n"
    "print('built', flush=True)\n"
    "time.sleep(600)\n"
)


def test_a_live_run_survives_cleanup_in_every_phase_and_finishes_ok(tmp_path, start_run):
    """The issue's case: cleanup again and again from before the cluster exists until the run has ended."""
    out = tmp_path / "B"
    before = snapshot()
    proc = start_run(out, "--profile", "10mbps", "--model", "tiny", "--batch-size", "4", "--steps", "8")
    key = staged_key(out, proc)
    assert owner_alive(key) is True, NOT_WIRED
    while_built = 0
    while proc.poll() is None:
        built = bool(namespaces_of(key))
        result = cleanup(key, tmp_path)
        assert key not in result.stdout, result.stdout
        while_built += built
    assert proc.wait() == 0, (tmp_path / "B.harness.log").read_text()
    assert while_built >= 1, "no cleanup ran while the run's namespaces existed"
    summary = summary_of(out)
    assert summary["status"] == "ok", summary.get("failure")
    assert own_leftovers(before, out, key) == {}
    assert not (ROOT_LOCK_DIR / f"{key}.lock").exists() and owner_alive(key) is None


def test_namespaces_of_a_run_between_set_up_and_its_workers_are_kept_until_its_owner_dies(new_key):
    """The window the old rule lost: namespaces built, no process in any of them yet, the owner alive."""
    key = new_key()
    names = [f"{key}-sw", f"{key}-c0", f"{key}-c1"]
    owner = subprocess.Popen([sys.executable, "-c", HOLD_AND_BUILD, key, *names], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "built"
        assert namespaces_of(key) == sorted(names)
        result = cleanup(key)
        assert "removed 0 namespaces" in result.stdout, result.stdout
        assert namespaces_of(key) == sorted(names)
    finally:
        owner.kill()
        owner.wait()
        owner.stdout.close()
    assert owner_alive(key) is False
    result = cleanup(key)
    assert "removed 3 namespaces" in result.stdout, result.stdout
    assert namespaces_of(key) == []
    assert not (ROOT_LOCK_DIR / f"{key}.lock").exists()


def test_a_run_without_a_lock_file_keeps_all_its_namespaces_while_any_has_a_process(new_key):
    """A run of an older harness (no lock file): the old rule, over all of the run's namespaces together."""
    key = new_key()
    for name in (f"{key}-sw", f"{key}-c0"):
        netns.create(name)
    sleeper = subprocess.Popen(["nsenter", f"--net=/run/netns/{key}-c0", "--", "sleep", "600"])
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{sleeper.pid}/ns/net").stat().st_ino == Path("/proc/self/ns/net").stat().st_ino:
            assert time.monotonic() < deadline, "nsenter did not enter the namespace"
            time.sleep(0.05)
        assert owner_alive(key) is None
        result = cleanup(key)
        assert "removed 0 namespaces" in result.stdout, result.stdout
        assert namespaces_of(key) == [f"{key}-c0", f"{key}-sw"]  # the switch too, though nothing lives in it
    finally:
        sleeper.kill()
        sleeper.wait()
    result = cleanup(key)
    assert "removed 2 namespaces" in result.stdout, result.stdout
    assert namespaces_of(key) == []


def test_cleanup_removes_everything_a_killed_harness_left(tmp_path, start_run):
    out = tmp_path / "run"
    before = snapshot()
    proc = start_run(out, "--profile", "100mbps", "--steps", "1000", *SMALL_RUN)
    wait_for_steps(out, 0, 1, proc)
    key = staged_key(out, proc)
    assert owner_alive(key) is True, NOT_WIRED
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while worker_pids(run_marker(out)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert worker_pids(run_marker(out)) == []
    # What SIGKILL left: the namespaces, the free lock file, the staging folder. The lock frees once the last
    # process holding its descriptor is gone (a helper pyroute2 forked may outlive the harness for a moment).
    assert len(namespaces_of(key)) == 3
    while owner_alive(key) and time.monotonic() < deadline + 10:
        time.sleep(0.1)
    assert owner_alive(key) is False
    staging = Path(run_marker(out))
    assert staging.is_dir()
    result = cleanup(key, tmp_path)
    assert "removed 3 namespaces" in result.stdout and "1 results folder" in result.stdout, result.stdout
    assert namespaces_of(key) == []
    assert not (ROOT_LOCK_DIR / f"{key}.lock").exists() and owner_alive(key) is None
    assert not staging.exists() and not out.exists()
    assert own_leftovers(before, out, key) == {}


def _nobody_can_run_the_harness() -> str | None:
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed"
    probe = subprocess.run(
        [*NOBODY, sys.executable, "-c", "import harness.cli, harness.lock"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if probe.returncode != 0:
        return f"user nobody cannot run this interpreter and repository ({probe.stderr.strip().splitlines()[-1:]})"
    return None


def test_cleanup_as_another_user_skips_roots_namespaces_and_says_why(new_key, tmp_path):
    reason = _nobody_can_run_the_harness()
    if reason:
        pytest.skip(reason)
    key = new_key()
    with RunLock(key):
        netns.create(f"{key}-sw")
        # Without --run-key, as the issue ran it: another user can remove nothing of root's anyway.
        for args in (["--run-key", key], []):
            result = subprocess.run(
                [*NOBODY, *HARNESS, "cleanup", *args, "--results", str(tmp_path)],
                capture_output=True,
                text=True,
                cwd=REPO,
                timeout=60,
            )
            text = result.stdout + result.stderr
            assert result.returncode == 0, text
            assert "Traceback" not in text
            assert f"{key}-sw" in text and "not checked" in text and "as root" in text, text
            assert "removed 0 namespaces" in text, text
        assert namespaces_of(key) == [f"{key}-sw"]
