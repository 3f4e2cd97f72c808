"""Backends build the emulated cluster and start ranks in it; the runner drives them through `ClusterBackend`."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from harness.errors import UserError
from harness.net.link import Profile
from harness.net.topology import Topology


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, known before anything is built, so that callers ask what it offers instead of
    comparing its name."""

    # The userspace delay line between clusters, where the kernel has no sch_netem.
    userspace_delay_line: bool
    # Link faults (--fault link-down, rate): the links can be set down and re-rated under a live run.
    link_faults: bool
    # The link probe (UDP echo between two clusters' namespaces) before a delay/jitter/loss run.
    link_check: bool
    # Its ranks are processes on this host's CPU cores (so more ranks than cores share them) and read its files.
    ranks_share_host_cpus: bool
    # The optional package its module needs (an extra of this project), and its module's
    # `unavailable_reason(world_size, gpus)`, which says why it cannot run here; None: it needs nothing more.
    extra: str | None = None


CAPABILITIES = {
    "netns": Capabilities(userspace_delay_line=True, link_faults=True, link_check=True, ranks_share_host_cpus=True),
    # Containers on a GPU host: their link is netem-only, shaped from the host; ranks own GPUs.
    "docker": Capabilities(
        userspace_delay_line=False, link_faults=False, link_check=False, ranks_share_host_cpus=False, extra="docker"
    ),
}
# What --backend accepts.
BACKENDS = tuple(CAPABILITIES)


def capabilities(name: str) -> Capabilities:
    if name not in CAPABILITIES:
        raise UserError(f"backend {name!r} is not available; use {' or '.join('--backend ' + b for b in BACKENDS)}")
    return CAPABILITIES[name]


def unavailable_reason(name: str, world_size: int, gpus: str = "auto") -> str | None:
    """Why backend `name` cannot run `world_size` ranks here, in one sentence naming the fix; None when it can."""
    extra = capabilities(name).extra
    if extra is None:
        return None
    try:
        module = importlib.import_module(f"harness.backends.{name}")
    except ImportError:
        return f"the {name} backend needs the {extra} SDK; pip install 'harness[{extra}]'"
    return module.unavailable_reason(world_size, gpus)


class Worker(Protocol):
    """A started rank; subprocess.Popen satisfies it."""

    def poll(self) -> int | None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...


class ClusterBackend(Protocol):
    applied_qdiscs: list[dict]  # what the backend asked the kernel for
    setup_s: float
    teardown_s: float

    def up(self) -> None:
        """Build the clusters and shape their links."""

    def down(self) -> None:
        """Remove everything `up` created; safe to call after a partial `up` and more than once."""

    def kernel_qdiscs(self) -> list[dict]:
        """The qdiscs as the kernel reports them."""

    def wire_bytes(self) -> int:
        """Bytes sent so far by all clusters onto the inter-cluster links, from the kernel's counters."""

    def vanished(self) -> str | None:
        """What of the cluster disappeared under the run (a namespace, a container), in words; None when intact."""

    def spawn(self, rank: int, argv: list[str], env: dict[str, str], log_path: Path) -> Worker:
        """Start rank `rank` running `argv` (the worker) with `env` (torchrun's variables) in its cluster."""


def make_backend(
    name: str,
    run_key: str,
    topology: Topology,
    profile: Profile,
    gpus: str = "auto",
    link_emulator: str | None = None,
    seed: int = 0,
    log_dir: Path | None = None,
) -> ClusterBackend:
    """The backend `name`; `gpus` (auto, none or GPU ids) matters to the docker backend only. `link_emulator` is
    what adds the profile's delay, jitter and loss: "netem", "userspace" (netns only) or None (none asked for);
    `seed` seeds the userspace delay line's loss and jitter, which logs into `log_dir`."""
    if name == "netns":
        from harness.backends.netns import NetnsCluster

        return NetnsCluster(run_key, topology, profile, link_emulator, seed, log_dir)
    if name == "docker":
        # Imported here: the docker SDK is an optional dependency.
        from harness.backends.docker import DockerCluster

        return DockerCluster(run_key, topology, profile, gpus, netem=link_emulator == "netem")
    capabilities(name)
    raise AssertionError(f"backend {name!r} has capabilities but no class")
