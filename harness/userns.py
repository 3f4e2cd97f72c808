"""Running without root: the harness re-enters itself as root of a user namespace of its own.

`unshare --user --map-root-user --net --mount` gives the inner harness CAP_NET_ADMIN over network namespaces it
creates itself, so the netns backend builds the whole cluster there; everything it makes vanishes with that
namespace. REEXEC_MARK in the environment marks the inner harness (it holds the outer one's pid). Nothing here
imports pyroute2 or torch: the CLI and the run lock use it before either is needed.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys

from harness.errors import UserError
from harness.process import set_parent_death_signal

REEXEC_MARK = "HARNESS_IN_USERNS"


class PrivilegeError(UserError):
    """Neither root nor user namespaces: the netns backend cannot create its namespaces."""


def user_namespaces_work() -> bool:
    try:
        return (
            subprocess.run(
                ["unshare", "--user", "--map-root-user", "--net", "--mount", "true"],
                capture_output=True,
                timeout=10,
            ).returncode
            == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


def needs_reexec() -> bool:
    """True when the harness must re-enter itself in a user namespace to build the cluster.

    HARNESS_USERNS=always takes that path as root too: the run then touches nothing of the host's network (its
    namespaces live and die in a private one), and the unprivileged path can be tested where root is all there is.
    """
    if os.geteuid() == 0 and os.environ.get("HARNESS_USERNS") != "always":
        return False
    if not user_namespaces_work():
        raise PrivilegeError(
            "the netns backend needs root or unprivileged user namespaces, and this machine allows neither; "
            "run as root (sudo) or enable them (sysctl kernel.unprivileged_userns_clone=1 / "
            "user.max_user_namespaces > 0)"
        )
    return True


def reexec_in_user_namespace(argv: list[str]) -> int:
    """Run `harness <argv>` again as root of a fresh user, network and mount namespace; returns its exit code.

    /run/netns belongs to the real root, so a private tmpfs is mounted over it (or over /run when it is missing)
    inside the new mount namespace; the host's /run is untouched. SIGINT and SIGTERM sent to this process are
    passed on to the inner harness, which tears its run down and exits; this process waits for it and exits with
    its code. Should this process die anyway, the inner harness gets SIGTERM (see `die_with_outer_harness`).
    """
    mount = "mount -t tmpfs harness /run/netns 2>/dev/null || { mount -t tmpfs harness /run && mkdir -p /run/netns; }"
    command = f"{mount} && exec {shlex.join([sys.executable, '-m', 'harness.cli', *argv])}"
    env = {**os.environ, REEXEC_MARK: str(os.getpid())}
    inner = subprocess.Popen(["unshare", "--user", "--map-root-user", "--net", "--mount", "sh", "-c", command], env=env)

    def forward(signum: int, frame: object) -> None:
        inner.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return inner.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def die_with_outer_harness() -> None:
    """In the inner harness of a re-exec: SIGTERM when the outer one dies, so the run is torn down, not orphaned.

    Set here rather than before the exec: entering a user namespace changes credentials, which clears the
    parent-death signal.
    """
    outer = os.environ.get(REEXEC_MARK, "")
    if not outer.isdigit():
        return
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != int(outer):
        sys.exit("harness: the outer harness exited before this run started")
