"""Who owns a run's resources: the run lock.

A run holds an exclusive `flock` on `<lock dir>/<run key>.lock` for its whole life (`RunLock`), from before it
creates anything until after it has removed everything. The kernel drops a flock when the last descriptor of it is
closed, so also when the harness dies by SIGKILL: a lock file that exists and is free proves that its owner is dead,
one that is locked proves that it lives. `harness cleanup` (harness/cleanup.py) removes only what provably dead
owners left, after claiming their locks here (`claim_dead_locks`), so no harness can start with their key meanwhile.

The lock file also holds, for humans (`cat` it), the owner's pid, when it took the lock, its command line, and the
run's staging folder, which lets `cleanup` find that folder wherever `--out` put it. Liveness is decided by the flock
alone, never by those lines.
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import stat
import sys
import time
from pathlib import Path

from harness.errors import UserError
from harness.userns import REEXEC_MARK

ROOT_LOCK_DIR = Path("/run/harness")
USER_LOCK_DIR_PREFIX = "/tmp/harness-locks-"
RUN_KEY = re.compile(r"^hx[0-9a-f]{6}$")
LOCK_FILE = re.compile(r"^(hx[0-9a-f]{6})\.lock$")


class LockError(UserError):
    """The run's lock cannot be taken; the message names the fix."""


class RunKeyInUse(LockError):
    """Another live harness holds a lock with this run key."""


def _host_uid() -> int:
    """This process's user id as the host sees it (inside the harness's user namespace, root is mapped to it)."""
    uid = os.getuid()
    try:
        for line in Path("/proc/self/uid_map").read_text().splitlines():
            inside, outside, count = (int(x) for x in line.split())
            if inside <= uid < inside + count:
                return outside + uid - inside
    except (OSError, ValueError):
        pass
    return uid


def is_real_root() -> bool:
    """Root of the host, not root of the harness's own user namespace (where only its private namespaces are)."""
    return os.geteuid() == 0 and not os.environ.get(REEXEC_MARK)


def lock_dir() -> Path:
    """Where this process keeps run locks.

    The real root (euid 0 and not inside the harness's user-namespace re-exec): /run/harness, next to the namespaces
    under /run/netns that its locks guard; readable by everyone (mode 0755, files 0644), so that any user can tell a
    live run from a dead one. Everyone else, and the re-exec (root only of a user namespace whose namespaces live in a
    private tmpfs and vanish with it, so there the lock only guards the results staging folder):
    /tmp/harness-locks-<uid>, mode 0700, <uid> as the host sees it, so the re-exec and its user's `cleanup` agree.
    """
    return ROOT_LOCK_DIR if is_real_root() else Path(f"{USER_LOCK_DIR_PREFIX}{_host_uid()}")


def _ensure_lock_dir() -> Path:
    directory = lock_dir()
    mode = 0o755 if directory == ROOT_LOCK_DIR else 0o700
    try:
        os.mkdir(directory, mode)
        os.chmod(directory, mode)  # whatever the umask
    except FileExistsError:
        pass
    except OSError as err:
        raise LockError(f"cannot create the run lock folder {directory} ({err.strerror}); make it writable") from None
    info = os.lstat(directory)
    # /tmp is everyone's: a folder someone else made there (or a link) must not be trusted with our locks.
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise LockError(f"the run lock folder {directory} is not a folder owned by this user; remove it and rerun")
    if stat.S_IMODE(info.st_mode) & 0o022 or (mode == 0o700 and stat.S_IMODE(info.st_mode) != mode):
        os.chmod(directory, mode)
    return directory


def _lock_dirs() -> list[Path]:
    """Every place a lock may be: this process's own, root's, then every user's (unreadable ones are skipped)."""
    found = [lock_dir(), ROOT_LOCK_DIR, *_user_lock_dirs()]
    return list(dict.fromkeys(found))


def _user_lock_dirs() -> list[Path]:
    """/tmp/harness-locks-<uid> of every user: real folders owned by that uid only (not links someone planted)."""
    parent, prefix = os.path.split(USER_LOCK_DIR_PREFIX)
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return []
    found = []
    for name in names:
        uid = name[len(prefix) :]
        if not (name.startswith(prefix) and uid.isdigit()):
            continue
        try:
            info = os.lstat(os.path.join(parent, name))
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid in (int(uid), os.getuid()):
            found.append(Path(parent) / name)
    return found


def _check_key(run_key: str) -> None:
    if not RUN_KEY.match(run_key):
        raise ValueError(f"run key {run_key!r} is not of the form hx + 6 hex digits")


def _same_file(fd: int, path: Path) -> bool | None:
    """Whether `path` still names the file open as `fd`; None when `path` is gone."""
    try:
        now, held = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return None
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


# Locks this process holds: its own runs' (alive), and dead runs' it claimed while cleaning up after them. A second
# descriptor of the same file would conflict with ours, so owner_alive answers for these without asking the kernel.
_held: dict[str, RunLock] = {}
_claimed: dict[str, list[tuple[Path, int]]] = {}


class RunLock:
    """The lock a run holds for its whole life: `with RunLock(config.run_key, staging=folder.staging): ...`.

    Taken exclusive and non-blocking (another live holder of the key raises RunKeyInUse); held until the block ends
    or the process dies, however it dies; on a clean exit the file is deleted, then the lock released.
    """

    def __init__(self, run_key: str, staging: Path | None = None):
        _check_key(run_key)
        self.run_key = run_key
        self.staging = staging
        self.path: Path | None = None
        self._fd: int | None = None
        self._pid = 0

    def acquire(self) -> RunLock:
        if self._fd is not None:
            raise RuntimeError(f"the lock of run {self.run_key} is already held")
        path = _ensure_lock_dir() / f"{self.run_key}.lock"
        for _ in range(10):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            except OSError as err:
                raise LockError(f"cannot open the run lock {path} ({err.strerror}); remove it and rerun") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunKeyInUse(
                    f"run key {self.run_key} is held by another live harness ({_describe_holder(path)}); "
                    "rerun to get a new key"
                ) from None
            # The previous holder may have deleted the file between our open and our lock: take the new one.
            if _same_file(fd, path):
                break
            os.close(fd)
        else:
            raise LockError(f"the lock file {path} keeps changing under this process; rerun")
        os.fchmod(fd, 0o644)  # whatever the umask: anyone may see who owns the run, and test whether it lives
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        lines = [f"pid {os.getpid()}", f"started {started}", f"command {shlex.join(sys.argv)}"]
        if self.staging is not None:
            lines.append(f"staging {os.path.abspath(self.staging)}")
        os.ftruncate(fd, 0)
        os.write(fd, ("\n".join(lines) + "\n").encode())
        self._fd, self.path, self._pid = fd, path, os.getpid()
        _held[self.run_key] = self
        return self

    def release(self) -> None:
        # A child forked while the lock was held (pyroute2 forks helpers) shares it and must leave it to the owner.
        if self._fd is None or os.getpid() != self._pid:
            return
        try:
            if self.path is not None and _same_file(self._fd, self.path):
                os.unlink(self.path)  # deleted while still locked: nobody can take it for a dead run's meanwhile
        finally:
            os.close(self._fd)
            self._fd = None
            _held.pop(self.run_key, None)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def staging_held(folder: Path) -> bool:
    """Whether a live run names `folder` as its results staging folder in its lock: true from the moment the run
    creates the folder, before it has written anything into it (so before its config.json names its key)."""
    wanted = os.path.abspath(folder)
    if any(lock.staging is not None and os.path.abspath(lock.staging) == wanted for lock in _held.values()):
        return True
    for directory in _lock_dirs():
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            path = directory / name
            if LOCK_FILE.match(name) and _lock_fields(path).get("staging") == wanted and _probe(path):
                return True
    return False


def _lock_fields(path: Path) -> dict[str, str]:
    """The lines a lock file holds for humans ("pid 123", "staging /x/.y.partial"), as a dict; {} if unreadable."""
    try:
        return dict(line.split(" ", 1) for line in path.read_text().splitlines() if " " in line)
    except (OSError, ValueError):
        return {}


def _describe_holder(path: Path) -> str:
    fields = _lock_fields(path)
    return f"pid {fields.get('pid', '?')} since {fields.get('started', '?')}, see {path}"


def _probe(path: Path) -> bool | None:
    """True: locked by someone; False: exists and free; None: absent or unreadable."""
    for _ in range(10):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            same = _same_file(fd, path)
            if same is None:
                return None  # its owner deleted it on a clean exit
            if same:
                return False
        finally:
            os.close(fd)  # also releases our shared lock at once
    return True  # a file that keeps being replaced is in use


def owner_alive(run_key: str) -> bool | None:
    """Whether the harness that owns `run_key` lives: True (its lock is held), False (the lock file exists and is
    free: its owner died), None (no lock file: an owner of an older version, or none at all)."""
    _check_key(run_key)
    if run_key in _held:
        return True
    if run_key in _claimed:
        return False
    found = False
    for directory in _lock_dirs():
        state = _probe(directory / f"{run_key}.lock")
        if state:
            return True
        found = found or state is False
    return False if found else None


def claim_dead_locks(run_key: str | None) -> None:
    """Take, exclusively, the lock of every dead run (of `run_key` only, when given) in the folders this process may
    write: while cleanup removes what those runs left, no harness can start with their key."""
    for directory in _lock_dirs():
        if not os.access(directory, os.W_OK):
            continue
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            match = LOCK_FILE.match(name)
            key = match.group(1) if match else None
            if key is None or (run_key and key != run_key) or key in _held:
                continue
            path = directory / name
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if not _same_file(fd, path):
                os.close(fd)
                continue
            _claimed.setdefault(key, []).append((path, fd))


def release_claims(removable: set[str]) -> tuple[list[Path], list[str]]:
    """Delete the claimed lock files of the runs in `removable` (nothing of them is left), then release every claim;
    returns the lock files removed and, in sentences, those that could not be."""
    removed, not_removed = [], []
    for key, claims in sorted(_claimed.items()):
        for path, fd in claims:
            try:
                if key in removable and _same_file(fd, path):
                    os.unlink(path)
                    removed.append(path)
            except OSError as err:
                not_removed.append(f"lock file {path} not removed ({err.strerror})")
            finally:
                os.close(fd)
    _claimed.clear()
    return removed, not_removed


def claimed_keys() -> set[str]:
    return set(_claimed)


def claimed_stagings(run_key: str | None) -> list[tuple[str, Path]]:
    """(run key, staging folder) as written in the claimed (dead) lock files this user owns; a pointer written by
    another user is not followed."""
    found = []
    for key, claims in _claimed.items():
        if run_key and key != run_key:
            continue
        for path, fd in claims:
            if os.fstat(fd).st_uid != os.geteuid():
                continue
            staging = _lock_fields(path).get("staging")
            if staging:
                found.append((key, Path(staging)))
    return found
