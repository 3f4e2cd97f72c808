"""The docker backend: each rank in its own container, the clusters joined by a private, shaped bridge network.

    cluster container <key>-c0 (sleep; owns the      bridge <key>-br          cluster container <key>-c1
    cluster's network and PID namespaces)            (network <key>-net)
      eth0 (tbf: uplink) ======== veth (tbf: downlink)    |    veth (tbf) ======== eth0 (tbf)
      lo (intra link) <- ranks <key>-r0, <key>-r1 ...          ... ranks <key>-r2, <key>-r3 -> lo

One small container per cluster holds the cluster's namespaces, like a pod's pause container; every rank of the
cluster runs in a container of its own (its image, its GPU) that joins them (network_mode/pid_mode
"container:<cluster container>"). So the ranks of a cluster talk over loopback, and only inter-cluster traffic
crosses the cluster's veth, exactly as in the netns backend. Both ends of each veth are shaped from the host: the
container's eth0 by entering its network namespace, the host-side peer in the host's namespace (the bridge-side end
shapes what arrives, so incast from several clusters is shaped too). Wire bytes are the host-side peers' receive
counters: what the clusters sent into the bridge, each crossing byte counted once.

Shaping from the host needs root; the containers get no extra capabilities. Every container and the network are
named with the run key and labelled with it, so teardown and `cleanup` remove exactly what a run made.

Images: one that has Python, torch and this package (compose/Dockerfile) runs the worker with its own `python`. The
development image (scripts/dev-image.sh, labelled `harness.host-python`) holds only a root filesystem skeleton; the
host's /usr, Python environment and this repository are bind-mounted read-only, so a container runs the very
interpreter and code the harness runs, with nothing to pull from a registry.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import docker
from docker.models.containers import Container
from docker.types import DeviceRequest
from pyroute2 import IPRoute, NetNS

import harness
from harness.errors import UserError
from harness.lock import RUN_KEY, owner_alive
from harness.net.counters import interface_counters
from harness.net.link import Profile
from harness.net.shaping import apply_link_spec, read_qdiscs
from harness.net.topology import Topology

DEFAULT_IMAGE = "harness-worker:dev"
IMAGE_ENV = "HARNESS_DOCKER_IMAGE"
# Set on images that bring no Python of their own and run the host's through read-only bind mounts.
HOST_PYTHON_LABEL = "harness.host-python"
RUN_KEY_LABEL = "harness.run_key"
# The harness process that owns a run's containers: `cleanup` leaves a live run's containers alone.
OWNER_LABEL = "harness.pid"
# Inside every container: the cluster's side of its veth, to which collectives are bound.
UPLINK = "eth0"
# Host directories the host's Python needs besides its environment (its shared libraries). On merged-/usr systems
# /lib and /lib64 are symlinks into /usr, which the development image reproduces instead of mounting them.
HOST_SYSTEM_DIRS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32")
# Variables of the harness's environment that tune or debug a rank (HARNESS_FAULT, NCCL_DEBUG, ...); a container
# gets these and nothing else of the host's environment.
PASSED_ENV_PREFIXES = ("HARNESS_", "NCCL_", "GLOO_", "TORCH_")


def docker_image() -> str:
    return os.environ.get(IMAGE_ENV, DEFAULT_IMAGE)


def parse_gpus(spec: str, world_size: int, nvidia_runtime: bool) -> list[str | None]:
    """The GPU each rank gets, by host device id (None: no GPU), from `--gpus`.

    "auto": one GPU per rank (rank r gets GPU r) when the engine has the nvidia runtime, none otherwise;
    "none": CPU only; "0,1,...": rank r gets the r-th listed GPU (NCCL refuses two ranks on one GPU).
    """
    if spec == "none" or (spec == "auto" and not nvidia_runtime):
        return [None] * world_size
    if spec == "auto":
        return [str(rank) for rank in range(world_size)]
    ids = [part.strip() for part in spec.split(",")]
    if not all(part.isdigit() for part in ids):
        raise UserError(f"--gpus {spec!r} is not understood; use auto, none or GPU ids like 0,1,2,3")
    if len(ids) < world_size:
        raise UserError(f"--gpus {spec} names {len(ids)} GPU(s) for {world_size} ranks; list one GPU per rank")
    return ids[:world_size]


def unavailable_reason(world_size: int, gpus: str = "auto") -> str | None:
    """Why a docker run cannot start here, in one sentence naming the fix; None when it can."""
    try:
        # A --gpus that can never be read is a mistake in the command, whatever this host has: said first.
        parse_gpus(gpus, world_size, nvidia_runtime=True)
    except UserError as err:
        return str(err)
    if os.geteuid() != 0:
        return (
            "the docker backend shapes the containers' links from the host and needs root; "
            "run the harness as root (sudo) or use --backend netns"
        )
    try:
        client = docker.from_env(timeout=5)
        client.info()
    except docker.errors.DockerException as err:
        where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        return (
            f"no docker engine answers at {where} ({type(err).__name__}); start one (apt-get install docker.io, "
            "then dockerd &) or use --backend netns"
        )
    try:
        client.images.get(docker_image())
    except docker.errors.ImageNotFound:
        return (
            f"docker image {docker_image()} is not present and no registry is reachable to pull it; build it with "
            f"scripts/dev-image.sh (or docker build -f compose/Dockerfile) or set {IMAGE_ENV}"
        )
    finally:
        client.close()
    return None


def _exit_status(code: int) -> int:
    """The engine reports a process killed by signal N as 128 + N; the runner expects Popen's -N."""
    return -(code - 128) if 128 < code <= 128 + signal.SIGRTMAX else code


class ContainerWorker:
    """One rank's container, seen as a process (the runner's Worker protocol).

    A thread follows the container: it copies its output to the rank's log as it comes (a failed run keeps its
    logs) and, when the output ends, records the exit status.
    """

    def __init__(self, container: Container, log_path: Path):
        self.container = container
        self.returncode: int | None = None
        self._follower = threading.Thread(target=self._follow, args=(log_path,), name=container.name, daemon=True)
        self._follower.start()

    def _follow(self, log_path: Path) -> None:
        # Unless the engine reports an exit, the container did not finish on its own: it was removed under us.
        code = 128 + signal.SIGKILL
        try:
            with log_path.open("ab") as log:
                for chunk in self.container.logs(stream=True, follow=True):
                    log.write(chunk)
                    log.flush()
            code = self.container.wait()["StatusCode"]
        except docker.errors.NotFound:
            pass
        finally:
            # Also when the engine failed us (the thread then prints why): the runner must not wait forever.
            self.returncode = _exit_status(code)

    def poll(self) -> int | None:
        return self.returncode

    def _signal(self, sig: signal.Signals) -> None:
        try:
            self.container.kill(signal=sig.name)
        except docker.errors.APIError:
            pass  # it has exited already, or is gone

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        self._follower.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.container.name, timeout or 0)
        return self.returncode


def _host_python_mounts() -> list[str]:
    """What the host's interpreter needs inside a container, read-only, at the same paths (as the interpreter
    names them: symlinks are not resolved, since the venv's python is one)."""
    wanted = [
        sys.base_prefix,
        sys.prefix,
        os.path.dirname(os.path.dirname(harness.__file__)),  # the repository (an editable install points into it)
        *(d for d in HOST_SYSTEM_DIRS if os.path.isdir(d) and not os.path.islink(d)),
    ]
    paths = sorted({Path(os.path.abspath(p)) for p in wanted}, key=lambda p: len(p.parts))
    # One mount covers everything below it.
    kept: list[Path] = []
    for path in paths:
        if not any(path.is_relative_to(parent) for parent in kept):
            kept.append(path)
    return [f"{path}:{path}:ro" for path in kept]


def _run_dir(argv: list[str]) -> Path:
    """The worker's --run-dir, made absolute: where it reads config.json and writes events."""
    return Path(os.path.abspath(argv[argv.index("--run-dir") + 1]))


class DockerCluster:
    """The containers and network of one run: created by `up()`, removed by `down()` (idempotent, always call it)."""

    def __init__(self, run_key: str, topology: Topology, profile: Profile, gpus: str = "auto", netem: bool = False):
        """`netem`: the profile's delay, jitter and loss go on the veths as netem (the runner has checked that the
        kernel has it; this backend has no userspace delay line)."""
        self.key = run_key
        self.topology = topology
        self.profile = profile
        self.gpus = gpus
        self.netem = netem
        self.image = docker_image()
        self.labels = {RUN_KEY_LABEL: run_key, OWNER_LABEL: str(os.getpid())}
        self.applied_qdiscs: list[dict] = []
        self.setup_s = self.teardown_s = 0.0
        # Log followers hold one connection each, on top of the calls the runner makes while they stream.
        self.client = docker.from_env(max_pool_size=topology.world_size + 4)
        self._clusters: list[Container] = []
        self._pids: list[int] = []  # each cluster container's process, the handle on its network namespace
        self._downlinks: list[str] = []  # each cluster's host-side veth, named by the engine
        self._gpu_of_rank: list[str | None] = []
        self._mounts: list[str] = []
        self._master_address = ""

    def network_name(self) -> str:
        return f"{self.key}-net"

    def bridge_name(self) -> str:
        return f"{self.key}-br"

    def cluster_name(self, cluster: int) -> str:
        return f"{self.key}-c{cluster}"

    def rank_name(self, rank: int) -> str:
        return f"{self.key}-r{rank}"

    def up(self) -> None:
        started = time.perf_counter()
        image = self.client.images.get(self.image)
        self._mounts = _host_python_mounts() if image.labels.get(HOST_PYTHON_LABEL) == "true" else []
        self._gpu_of_rank = parse_gpus(
            self.gpus, self.topology.world_size, "nvidia" in self.client.info().get("Runtimes", {})
        )
        network = self.client.networks.create(
            self.network_name(),
            driver="bridge",
            # Nothing outside the run is reachable, so nothing but the run's own traffic uses the shaped links.
            internal=True,
            options={"com.docker.network.bridge.name": self.bridge_name()},
            labels=self.labels,
        )
        for c in range(self.topology.clusters):
            container = self.client.containers.run(
                self.image,
                ["sleep", "infinity"],
                name=self.cluster_name(c),
                hostname=self.cluster_name(c),
                network=network.name,
                volumes=self._mounts,
                labels={**self.labels, "harness.role": "cluster"},
                detach=True,
            )
            self._clusters.append(container)
            container.reload()
            self._pids.append(container.attrs["State"]["Pid"])
            if c == 0:
                self._master_address = container.attrs["NetworkSettings"]["Networks"][network.name]["IPAddress"]
        self._shape()
        self.setup_s = time.perf_counter() - started

    def _shape(self) -> None:
        intra = self.profile.intra_cluster
        with IPRoute() as host:
            bridge = host.link_lookup(ifname=self.bridge_name())[0]
            for c, pid in enumerate(self._pids):
                with NetNS(f"/proc/{pid}/ns/net", flags=0) as ns:
                    (eth,) = ns.get_links(ifname=UPLINK)
                    self.applied_qdiscs += apply_link_spec(ns, UPLINK, self.profile.uplink(c), self.netem)
                    # Ranks of one cluster reach each other's uplink address over loopback: the intra link.
                    self.applied_qdiscs += apply_link_spec(ns, "lo", intra, self.netem, one_hop=True)
                # The peer of the container's eth0 is the host-side end of its veth, on the run's bridge.
                (peer,) = host.get_links(eth.get_attr("IFLA_LINK"))
                if peer.get_attr("IFLA_MASTER") != bridge:
                    raise RuntimeError(f"{self.cluster_name(c)}'s veth peer is not on bridge {self.bridge_name()}")
                self._downlinks.append(peer.get_attr("IFLA_IFNAME"))
                self.applied_qdiscs += apply_link_spec(host, self._downlinks[c], self.profile.downlink(c), self.netem)

    def kernel_qdiscs(self) -> list[dict]:
        """The qdiscs as the kernel reports them now, for environment.json."""
        found = []
        with IPRoute() as host:
            for downlink in self._downlinks:
                found += [{"netns": "host", **q} for q in read_qdiscs(host, downlink)]
        for c, pid in enumerate(self._pids):
            with NetNS(f"/proc/{pid}/ns/net", flags=0) as ns:
                for dev in (UPLINK, "lo"):
                    found += [{"netns": self.cluster_name(c), **q} for q in read_qdiscs(ns, dev)]
        return found

    def wire_bytes(self) -> int:
        """Bytes the clusters have sent into the bridge so far (each crossing byte counted once)."""
        with IPRoute() as host:
            return sum(interface_counters(host, downlink)[1] for downlink in self._downlinks)

    def vanished(self) -> str | None:
        for c, container in enumerate(self._clusters):
            try:
                container.reload()
                running = container.status == "running"
            except docker.errors.NotFound:
                running = False
            if not running:
                return f"the container holding cluster {c} ({container.name}) stopped or disappeared during the run"
        return None

    def spawn(self, rank: int, argv: list[str], env: dict[str, str], log_path: Path) -> ContainerWorker:
        cluster = self._clusters[self.topology.cluster_of(rank)]
        run_dir = _run_dir(argv)
        env = {
            **{k: v for k, v in os.environ.items() if k.startswith(PASSED_ENV_PREFIXES)},
            **env,
            # The engine chose the addresses (so runs never collide on the host): rank 0 listens on cluster 0's.
            "MASTER_ADDR": self._master_address,
            # Bind every collective to the shaped uplink; NCCL must not find a faster path around it (ARCHITECTURE.md).
            "GLOO_SOCKET_IFNAME": UPLINK,
            "NCCL_SOCKET_IFNAME": UPLINK,
            "NCCL_P2P_DISABLE": "1",
            "NCCL_SHM_DISABLE": "1",
            "NCCL_IB_DISABLE": "1",
            "HARNESS_UPLINK": UPLINK,
        }
        gpu = self._gpu_of_rank[rank]
        container = self.client.containers.run(
            self.image,
            # The host's interpreter where it is mounted; otherwise the image's own Python with the package.
            argv if self._mounts else ["python", *argv[1:]],
            name=self.rank_name(rank),
            # The cluster container's namespaces: loopback to the cluster's other ranks, and this rank's process is
            # not PID 1 there, so SIGTERM stops it as it stops a process on the host.
            network_mode=f"container:{cluster.id}",
            pid_mode=f"container:{cluster.id}",
            environment=env,
            # The run folder at the same path, and the harness's working directory, where a relative path resolves.
            volumes=[*self._mounts, f"{run_dir}:{run_dir}:rw"],
            working_dir=os.getcwd(),
            device_requests=[DeviceRequest(device_ids=[gpu], capabilities=[["gpu"]])] if gpu is not None else None,
            labels={**self.labels, "harness.role": "rank", "harness.rank": str(rank)},
            detach=True,
        )
        return ContainerWorker(container, log_path)

    def down(self) -> None:
        """Remove every container and the network this run created, found by its label (also after a partial up)."""
        started = time.perf_counter()
        _remove_run(self.client, self.key)
        self.client.close()
        self._clusters.clear()
        self._pids.clear()
        self._downlinks.clear()
        self.teardown_s = time.perf_counter() - started


def _remove_run(client: docker.DockerClient, run_key: str) -> tuple[list[str], list[str]]:
    """Remove the containers (ranks before the cluster containers they join) and network of `run_key`; returns the
    names of the containers and of the networks removed."""
    selector = {"label": f"{RUN_KEY_LABEL}={run_key}"}
    containers_removed, networks_removed = [], []
    containers = client.containers.list(all=True, filters=selector)
    for container in sorted(containers, key=lambda c: c.labels.get("harness.role") != "rank"):
        if container.name.startswith(f"{run_key}-"):
            try:
                container.remove(force=True)
                containers_removed.append(container.name)
            except docker.errors.NotFound:
                pass
    for network in client.networks.list(filters=selector):
        if network.name.startswith(f"{run_key}-"):
            try:
                network.remove()
                networks_removed.append(network.name)
            except docker.errors.NotFound:
                pass
    return containers_removed, networks_removed


def _harness_alive(pid: str, created: float | None = None) -> bool:
    """Whether process `pid` (an owner label) is a harness that was already running at `created` (when the labelled
    object was made, seconds since the epoch). The kernel reuses pids: a process that started after the object was
    made is not its owner, whatever its command line."""
    try:
        if not pid.isdigit() or b"harness" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return False
        if created is None:
            return True
        # Field 22 of /proc/<pid>/stat, the start in clock ticks after boot; the command (field 2) may hold spaces.
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime ")
        )
        # btime has a resolution of one second.
        return boot + ticks / os.sysconf("SC_CLK_TCK") <= created + 2.0
    except (OSError, ValueError, IndexError, StopIteration):
        return False


def cleanup(run_key: str | None = None) -> tuple[list[str], list[str]]:
    """Remove the containers and networks of runs whose harness died without tearing down (SIGKILL); returns the
    names of the containers and of the networks removed.

    Only objects labelled with a run key are considered. Ownership decides (harness/lock.py): a run's objects are
    removed when its lock file exists and is free (its owner is dead), kept when the lock is held; a run without a
    lock file (a harness of an older version) is kept while its owner pid label names a harness process that was
    running when the objects were made. With `run_key`, only that run's.
    """
    import re
    from datetime import datetime

    def created_at(text: str | None) -> float | None:
        # The engine writes "2026-01-31T12:34:56.123456789Z" (or an offset), more digits than Python parses.
        match = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.\d+)?(Z|[+-]\d\d:\d\d)?$", text or "")
        if not match:
            return None
        zone = match.group(2) or "Z"
        return datetime.fromisoformat(match.group(1) + ("+00:00" if zone == "Z" else zone)).timestamp()

    client = docker.from_env()
    try:
        selector = {"label": f"{RUN_KEY_LABEL}={run_key}" if run_key else RUN_KEY_LABEL}
        found = [(c.labels, c.attrs.get("Created")) for c in client.containers.list(all=True, filters=selector)]
        found += [(n.attrs.get("Labels") or {}, n.attrs.get("Created")) for n in client.networks.list(filters=selector)]
        owners: dict[str, list[tuple[str, float | None]]] = {}
        for labels, created in found:
            key = labels.get(RUN_KEY_LABEL, "")
            if RUN_KEY.match(key):  # anything else is not a run of ours
                owners.setdefault(key, []).append((labels.get(OWNER_LABEL, ""), created_at(created)))
        containers, networks = [], []
        for key, owned in sorted(owners.items()):
            alive = owner_alive(key)
            if alive is None:
                alive = any(_harness_alive(pid, created) for pid, created in owned)
            if not alive:
                removed = _remove_run(client, key)
                containers += removed[0]
                networks += removed[1]
        return containers, networks
    finally:
        client.close()
