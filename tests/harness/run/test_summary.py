"""environment.json: what a run's numbers depend on, recorded truthfully also for a run without root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import harness
from harness.run.summary import code_dirty, environment, summarize

REPO = Path(harness.__file__).resolve().parent.parent


def test_environment_records_the_commit_and_both_user_ids():
    env = environment({"backend": "netns"})
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert env["git_commit"] == (head.strip() or None)
    assert env["euid"] == os.geteuid() and env["host_uid"] == os.getuid()  # no user namespace here
    assert env["backend"] == "netns"


def test_a_run_in_a_user_namespace_records_the_commit_and_the_hosts_uid():
    """As a normal user the harness runs as root of its own user namespace, where the root-owned checkout looks
    foreign: git refused it ("dubious ownership") and git_commit was null, and euid said 0."""
    if os.geteuid() != 0:
        pytest.skip("needs root to become another user")
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if not head or os.stat(REPO).st_uid == 65534:
        pytest.skip("needs a git checkout that user nobody does not own")
    site = next(Path(sys.prefix, "lib").glob("python3*/site-packages"))
    home = tempfile.mkdtemp(prefix="harness-nobody-", dir="/tmp")
    os.chmod(home, 0o777)
    code = "import json; from harness.run.summary import environment; print(json.dumps(environment({})))"
    command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
               "unshare", "--user", "--map-root-user", "/usr/bin/python3", "-c", code]  # fmt: skip
    env = {"PATH": os.environ["PATH"], "HOME": home, "PYTHONPATH": f"{REPO}:{site}"}
    try:
        result = subprocess.run(command, capture_output=True, text=True, cwd=home, env=env, timeout=120)
    finally:
        os.rmdir(home)
    if result.returncode != 0 and "import" in result.stderr.lower():
        pytest.skip(f"user nobody cannot run the harness with /usr/bin/python3: {result.stderr.strip()[-200:]}")
    assert result.returncode == 0, result.stderr
    recorded = json.loads(result.stdout.splitlines()[-1])
    assert recorded["git_commit"] == head
    assert recorded["git_dirty"] is not None
    assert (recorded["euid"], recorded["host_uid"]) == (0, 65534)


def test_a_run_whose_events_are_damaged_still_gets_a_failed_summary_naming_the_file(tmp_path):
    """The runner's teardown summarizes its own folder: an unreadable events line must not cost the summary."""
    from harness.run.config import RunConfig
    from harness.run.folder import RunPaths
    from tests.harness.fakeruns import write_run

    run = write_run(tmp_path, "r")
    paths = RunPaths(run)
    lines = paths.events(0).read_text().splitlines()
    lines[1] = "[1, 2]"
    paths.events(0).write_text("\n".join(lines) + "\n")
    summary = summarize(RunConfig.load(paths.config), run, None, {})
    assert summary["status"] == "failed"
    assert str(paths.events(0)) in summary["failure"] and "line 2" in summary["failure"]


def test_only_changed_code_marks_a_run_dirty(tmp_path):
    """A study writes its results into the checkout; resuming it there must not call its own runs dirty."""

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    (tmp_path / "harness").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "harness" / "method.py").write_text("lr = 1\n")
    (tmp_path / "results" / "compare.md").write_text("old\n")
    (tmp_path / "README.md").write_text("old\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "code and results")
    assert code_dirty(tmp_path) is False
    (tmp_path / "results" / "compare.md").write_text("regenerated\n")
    (tmp_path / "README.md").write_text("new row\n")
    assert code_dirty(tmp_path) is False
    (tmp_path / "harness" / "method.py").write_text("lr = 2\n")
    assert code_dirty(tmp_path) is True


def test_a_step_only_the_other_replica_logged_still_counts(tmp_path):
    """A replica killed between its share of a round's exchange and logging that step heals past it (a real run of
    the goodput study did): the step is in the final model, so the run still has every step."""
    from harness.run.config import RunConfig
    from harness.run.folder import RunPaths
    from tests.harness.fakeruns import write_run

    run = write_run(tmp_path, "r", steps=20)
    paths = RunPaths(run)
    events = [json.loads(line) for line in paths.events(0).read_text().splitlines()]
    kept = [e for e in events if not (e["kind"] == "step" and e["step"] == 13)]
    assert len(kept) == len(events) - 1
    paths.events(0).write_text("".join(json.dumps(e) + "\n" for e in kept))
    summary = summarize(RunConfig.load(paths.config), run, None, {})
    assert summary["status"] == "ok" and summary["steps"] == 20
