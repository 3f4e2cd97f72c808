"""Run locks and what cleanup may remove: a lock held by a live process reads alive, by a killed one dead."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import lock as run_lock
from harness.cleanup import CleanupReport, cleanup, stale_partials
from harness.errors import UserError
from harness.lock import RunKeyInUse, RunLock, owner_alive

HOLD = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from harness.lock import RunLock\n"
    "RunLock(sys.argv[1], staging=Path(sys.argv[2]) if len(sys.argv) > 2 else None).acquire()\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


def new_key() -> str:
    return "hx" + secrets.token_hex(3)


@pytest.fixture
def holders():
    """Start child processes that take a run's lock and sleep; kill them at the end and remove their lock files."""
    started: list[tuple[subprocess.Popen, str]] = []

    def hold(key: str, staging: Path | None = None) -> subprocess.Popen:
        argv = [sys.executable, "-c", HOLD, key, *([str(staging)] if staging else [])]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        started.append((proc, key))
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield hold
    for proc, key in started:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        (run_lock.lock_dir() / f"{key}.lock").unlink(missing_ok=True)


def kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def staging(parent: Path, key: str, name: str | None = None, age_s: float = 0) -> Path:
    folder = parent / f".{name or key}.partial"
    (folder / "events").mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"run_key": key}))
    (folder / "events" / "rank0.jsonl").write_text("")
    if age_s:
        then = time.time() - age_s
        for path in [folder, *folder.rglob("*")]:
            os.utime(path, (then, then))
    return folder


def test_the_lock_folder_is_roots_only_for_the_real_root(monkeypatch):
    monkeypatch.delenv(run_lock.REEXEC_MARK, raising=False)
    if os.geteuid() == 0:
        assert run_lock.lock_dir() == Path("/run/harness")
    else:
        assert run_lock.lock_dir() == Path(f"/tmp/harness-locks-{os.getuid()}")
    # Inside the user-namespace re-exec, root is only root of its own namespaces.
    monkeypatch.setenv(run_lock.REEXEC_MARK, "1")
    assert run_lock.lock_dir().name.startswith("harness-locks-")


def test_a_lock_held_by_a_live_process_reads_alive_and_dead_once_it_is_killed(holders):
    key = new_key()
    assert owner_alive(key) is None
    proc = holders(key)
    lock_file = run_lock.lock_dir() / f"{key}.lock"
    assert owner_alive(key) is True
    assert f"pid {proc.pid}\n" in lock_file.read_text()  # for humans; liveness is the flock's
    kill(proc)
    assert lock_file.exists()
    assert owner_alive(key) is False


def test_a_run_key_held_elsewhere_cannot_be_taken(holders):
    key = new_key()
    proc = holders(key)
    with pytest.raises(RunKeyInUse, match=f"pid {proc.pid}"):
        RunLock(key).acquire()
    assert owner_alive(key) is True


def test_a_clean_exit_deletes_the_lock_file():
    key = new_key()
    with RunLock(key) as lock:
        assert lock.path is not None and lock.path.exists()
        assert owner_alive(key) is True
        if run_lock.lock_dir() != run_lock.ROOT_LOCK_DIR:
            assert lock.path.parent.stat().st_mode & 0o777 == 0o700
    assert not lock.path.exists()
    assert owner_alive(key) is None


def test_a_dead_owners_lock_can_be_taken_again(holders):
    key = new_key()
    kill(holders(key))
    with RunLock(key):
        assert owner_alive(key) is True
    assert owner_alive(key) is None


def test_stale_partials_are_the_dead_owners_and_the_long_idle_unowned(tmp_path, holders):
    dead, live, unowned_old, unowned_new, live_old = (new_key() for _ in range(5))
    kill(holders(dead))
    holders(live)
    holders(live_old)
    expected = [staging(tmp_path, dead), staging(tmp_path, unowned_old, age_s=2 * 3600)]
    kept = [
        staging(tmp_path, live),
        staging(tmp_path, live_old, age_s=2 * 3600),  # a held lock is never stale, however old
        staging(tmp_path, unowned_new),
    ]
    # Not staging folders: no leading dot, a plain file, no config.json, a run key of another form.
    (tmp_path / f"{dead}.partial").mkdir()
    (tmp_path / f"{dead}.partial" / "config.json").write_text(json.dumps({"run_key": dead}))
    (tmp_path / ".file.partial").write_text(json.dumps({"run_key": dead}))
    (tmp_path / ".noconfig.partial").mkdir()
    staging(tmp_path, "../etc", name="badkey")
    (tmp_path / ".link.partial").symlink_to(expected[0])
    assert sorted(stale_partials([tmp_path])) == sorted(expected)
    assert stale_partials([tmp_path], run_key=dead) == [expected[0]]
    assert all(folder.exists() for folder in kept)


def test_cleanup_removes_a_dead_runs_staging_folder_wherever_it_is_and_its_lock_file(tmp_path, holders):
    key, live = new_key(), new_key()
    folder = staging(tmp_path / "elsewhere", key)
    kill(holders(key, staging=folder))
    live_folder = staging(tmp_path / "elsewhere", live)
    holders(live, staging=live_folder)
    # Always with a run key here: other runs on this host are not this test's to remove.
    report = cleanup(run_key=key, results_dirs=[])
    assert report.partial_folders == [folder]
    assert report.lock_files == [run_lock.lock_dir() / f"{key}.lock"]
    assert cleanup(run_key=live, results_dirs=[tmp_path / "elsewhere"]).partial_folders == []
    assert not folder.exists() and live_folder.exists()
    assert owner_alive(key) is None and owner_alive(live) is True
    assert report.describe().endswith(f"1 results folder ({folder})")


def test_cleanup_with_a_run_key_touches_only_that_run(tmp_path, holders):
    key, other = new_key(), new_key()
    folders = [staging(tmp_path, key), staging(tmp_path, other)]
    kill(holders(key))
    kill(holders(other))
    report = cleanup(run_key=key, results_dirs=[tmp_path])
    assert report.partial_folders == [folders[0]]
    assert folders[1].exists() and owner_alive(other) is False


def test_the_report_reads_as_one_line():
    report = CleanupReport(namespaces=["hx123456-c0", "hx123456-sw"], networks=["hx123456-net"])
    assert report.describe() == (
        "removed 2 namespaces (hx123456-c0, hx123456-sw), 0 containers, 1 network (hx123456-net), 0 results folders"
    )


def test_harness_cleanup_says_what_it_removed_before_what_it_could_not(monkeypatch):
    from click.testing import CliRunner

    from harness import cleanup as cleanup_module
    from harness import cli

    not_removed = ["results folder /x not removed (Permission denied)"]
    report = CleanupReport(namespaces=["hx123456-c0"], not_checked=not_removed)
    monkeypatch.setattr(cleanup_module, "cleanup", lambda run_key, results_dirs: report)
    result = CliRunner().invoke(cli.main, ["cleanup"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [report.describe(), report.not_checked[0]]


# --- the docker backend's cleanup, against a fake engine (no engine is needed) ---


class FakeObject:
    def __init__(self, engine: FakeEngine, name: str, labels: dict[str, str], created: str):
        self.engine, self.name, self.labels = engine, name, labels
        self.attrs = {"Labels": labels, "Created": created}

    def remove(self, force: bool = False) -> None:
        self.engine.removed.append(self.name)


class FakeCollection:
    def __init__(self, objects: list[FakeObject]):
        self.objects = objects

    def list(self, all: bool = False, filters: dict | None = None) -> list[FakeObject]:
        wanted = (filters or {}).get("label", "")
        name, _, value = wanted.partition("=")
        found = [o for o in self.objects if name in o.labels and (not value or o.labels[name] == value)]
        return [o for o in found if o.name not in o.engine.removed]


class FakeEngine:
    def __init__(self):
        self.removed: list[str] = []
        self.containers = FakeCollection([])
        self.networks = FakeCollection([])

    def add_run(self, key: str, owner: int, created: str) -> None:
        from harness.backends.docker import OWNER_LABEL, RUN_KEY_LABEL

        labels = {RUN_KEY_LABEL: key, OWNER_LABEL: str(owner)}
        self.containers.objects += [
            FakeObject(self, f"{key}-c0", {**labels, "harness.role": "cluster"}, created),
            FakeObject(self, f"{key}-r0", {**labels, "harness.role": "rank"}, created),
        ]
        self.networks.objects.append(FakeObject(self, f"{key}-net", labels, created))

    def close(self) -> None:
        pass


def test_docker_cleanup_decides_by_the_lock_then_by_a_harness_pid_older_than_the_run(monkeypatch, holders):
    docker_backend = pytest.importorskip("harness.backends.docker")
    live, dead, old_live, old_reused = (new_key() for _ in range(4))
    engine = FakeEngine()
    now = time.strftime("%Y-%m-%dT%H:%M:%S.123456789Z", time.gmtime(time.time() + 5))
    live_owner = holders(live)
    engine.add_run(live, live_owner.pid, now)
    dead_owner = holders(dead)
    engine.add_run(dead, dead_owner.pid, now)
    kill(dead_owner)
    # No lock file (a harness of an older version): a harness process started before the objects owns them; the
    # same pid on objects made before that process started is a reused pid.
    pid = live_owner.pid  # its command line holds "harness"
    engine.add_run(old_live, pid, now)
    engine.add_run(old_reused, pid, "2001-02-03T04:05:06.000000000Z")
    monkeypatch.setattr(docker_backend.docker, "from_env", lambda **kw: engine)
    containers, networks = docker_backend.cleanup(None)
    gone = {dead, old_reused}
    assert sorted(networks) == sorted(f"{k}-net" for k in gone)
    assert sorted(containers) == sorted(f"{k}-{s}" for k in gone for s in ("r0", "c0"))
    # Ranks go before the cluster container whose namespaces they join.
    assert containers.index(f"{dead}-r0") < containers.index(f"{dead}-c0")


def test_lock_folders_planted_as_links_are_not_read(tmp_path):
    planted = Path(f"{run_lock.USER_LOCK_DIR_PREFIX}{4_000_000_000 + secrets.randbelow(1000)}")
    planted.symlink_to(tmp_path)
    try:
        assert planted not in run_lock._lock_dirs()
    finally:
        planted.unlink()


def test_cleanup_refuses_a_run_key_that_is_not_one():
    with pytest.raises(UserError, match="hx and 6 hex digits"):
        cleanup(run_key="../../etc")


def test_a_lock_folder_that_cannot_be_made_is_named_with_the_fix(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(run_lock, "lock_dir", lambda: tmp_path / "a-file" / "locks")
    with pytest.raises(
        run_lock.LockError, match=r"cannot create the run lock folder .*a-file/locks .*make it writable"
    ):
        RunLock(new_key()).acquire()


def test_a_lock_folder_planted_as_a_link_is_refused_not_used(tmp_path, monkeypatch):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "locks").symlink_to(tmp_path / "elsewhere")
    monkeypatch.setattr(run_lock, "lock_dir", lambda: tmp_path / "locks")
    with pytest.raises(run_lock.LockError, match="is not a folder owned by this user; remove it and rerun"):
        RunLock(new_key()).acquire()
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_a_lock_file_that_cannot_be_opened_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "lock_dir", lambda: tmp_path)
    key = new_key()
    (tmp_path / f"{key}.lock").symlink_to(tmp_path / "target")  # O_NOFOLLOW: a planted link is not followed
    with pytest.raises(run_lock.LockError, match=rf"cannot open the run lock .*{key}.lock .*remove it and rerun"):
        RunLock(key).acquire()
    assert not (tmp_path / "target").exists()


@pytest.mark.parametrize("key", ["hx12345", "HX123456", "hx12345g", "../../etc"])
def test_a_run_key_that_is_not_one_is_refused(key):
    with pytest.raises(ValueError, match="is not of the form hx \\+ 6 hex digits"):
        RunLock(key)
