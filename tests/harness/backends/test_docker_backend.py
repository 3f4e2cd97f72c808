"""Real runs with --backend docker: train, measure, fail, and leave no container, network or namespace behind.

Needs root and a docker engine (.ci/run installs Debian's docker.io and starts dockerd, which turns on ip_forward,
sets the FORWARD policy to DROP and adds docker0 on the host). Without one every test that needs it is skipped, with
the reason shown by `pytest -rs`. The development image is built if missing (scripts/dev-image.sh, about a second).
All of that happens in the `client` fixture, once per module: collecting this module only imports it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.cleanup import cleanup as cleanup_runs
from harness.errors import UserError
from harness.lock import owner_alive
from tests.harness.e2e import SMALL_RUN, harness, run_marker, summary_of, wait_for_steps
from tests.harness.hoststate import leftovers, snapshot

# The docker SDK is an optional dependency (pip install .[docker]); the backend module needs it to import.
docker = pytest.importorskip("docker", reason="the docker SDK is not installed; pip install '.[docker]'")

from harness.backends.docker import RUN_KEY_LABEL, cleanup, parse_gpus, unavailable_reason  # noqa: E402

# One engine test at a time beside the other tests (tests/harness/conftest.py): assert_nothing_left compares the
# engine's namespaces host-wide.
pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("docker_engine_to_itself")]

REPO = Path(__file__).resolve().parents[3]
DOCKER = ["--backend", "docker"]


@pytest.fixture(scope="module")
def client() -> Iterator[docker.DockerClient]:
    """A client of the engine, with the development image present; skips the test when there is no engine."""
    if os.geteuid() != 0:
        pytest.skip("the docker backend shapes from the host and needs root")
    try:
        engine = docker.from_env(timeout=10)
        engine.ping()
    except Exception as err:  # the SDK's several types for "nothing answers"
        pytest.skip(f"no docker engine is reachable ({type(err).__name__}: {err}); install docker.io and start dockerd")
    built = subprocess.run([REPO / "scripts" / "dev-image.sh"], capture_output=True, text=True)
    assert built.returncode == 0, built.stdout + built.stderr
    reason = unavailable_reason(2)
    assert reason is None, reason
    yield engine
    engine.close()


def run_key_of(out: Path) -> str:
    staged = out.parent / f".{out.name}.partial" / "config.json"
    return json.loads((staged if staged.exists() else out / "config.json").read_text())["run_key"]


def docker_leftovers(client: docker.DockerClient, run_key: str) -> list[str]:
    """Containers and networks carrying the run's label (stopped ones too)."""
    selector = {"label": f"{RUN_KEY_LABEL}={run_key}"}
    return [c.name for c in client.containers.list(all=True, filters=selector)] + [
        n.name for n in client.networks.list(filters=selector)
    ]


def docker_netns() -> set[str]:
    """The engine's own network namespaces (one per cluster container), bind-mounted under /run/docker/netns.

    Only mounted ones are alive: the engine unmounts a namespace with its container and deletes the empty file later.
    """
    mounts = (line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines())
    return {m for m in mounts if m.startswith(("/run/docker/netns/", "/var/run/docker/netns/"))}


def snapshot_all() -> dict:
    return {**snapshot(), "docker_netns": docker_netns()}


def assert_nothing_left(client: docker.DockerClient, before: dict, out: Path) -> None:
    run_key = run_key_of(out)
    assert docker_leftovers(client, run_key) == []
    assert docker_netns() - before["docker_netns"] == set()
    found = leftovers(before, run_marker(out))
    # Other runs on this host come and go in /run/netns meanwhile; only this run's names count.
    found["netns"] = [name for name in found.get("netns", []) if name.startswith(run_key)]
    assert {k: v for k, v in found.items() if v} == {}


def step_losses(out: Path, rank: int) -> list[float]:
    lines = (out / "events" / f"rank{rank}.jsonl").read_text().splitlines()
    return [e["loss"] for e in map(json.loads, lines) if e["kind"] == "step"]


@pytest.fixture
def start_long_run(client):
    """Starts 1000-step docker runs; whatever a test does, no harness or container of them outlives it."""
    started: list[tuple[subprocess.Popen, Path]] = []

    def start(out: Path) -> subprocess.Popen:
        command = [sys.executable, "-m", "harness.cli", "run", *DOCKER, "--profile", "100mbps", "--steps", "1000"]
        proc = subprocess.Popen(
            [*command, *SMALL_RUN, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        started.append((proc, out))
        return proc

    yield start
    for proc, out in started:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
            # Only this test's run: other runs on the host are not ours to touch.
            cleanup(run_key_of(out))


def test_docker_run_trains_counts_its_bytes_and_leaves_nothing(tmp_path, client):
    before = snapshot_all()
    out = tmp_path / "docker-run"
    result = harness("run", *DOCKER, "--profile", "1gbps", "--steps", 60, *SMALL_RUN, "--out", out)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = summary_of(out)
    assert summary["status"] == "ok" and summary["backend"] == "docker"
    assert summary["steps"] == 60 and summary["tokens"] == 60 * 2 * 4 * 128
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.0
    # Both counters agree with the all-reduce's accounting: eth0 in the containers (the workers' own) and the
    # host-side veths (the backend's); the excess is TCP/IP framing and ACKs.
    assert 1.0 <= summary["wire_bytes"] / summary["payload_bytes"] < 1.10
    assert 1.0 <= summary["wire_bytes_run"] / summary["payload_bytes"] < 1.10
    environment = json.loads((out / "environment.json").read_text())
    shaped = [q for q in environment["kernel_qdiscs"] if q["kind"] == "tbf"]
    # Both ends of both clusters' links: eth0 inside each cluster container and its veth peer on the host.
    assert len(shaped) == 4 and all(q["rate_bps"] == 10**9 for q in shaped)
    run_key = run_key_of(out)
    assert {q["netns"] for q in shaped} == {"host", f"{run_key}-c0", f"{run_key}-c1"}
    assert_nothing_left(client, before, out)


def test_killed_rank_container_is_named_and_nothing_is_left(tmp_path, client, start_long_run):
    before = snapshot_all()
    out = tmp_path / "docker-kill"
    proc = start_long_run(out)
    wait_for_steps(out, 1, 2, proc)
    client.containers.get(f"{run_key_of(out)}-r1").kill()
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, output
    summary = summary_of(out)
    assert summary["status"] == "failed"
    assert summary["failure"] == "rank 1 (cluster 1, stage 0) was killed by SIGKILL"
    assert summary["steps"] >= 2  # events written before the kill are kept
    assert_nothing_left(client, before, out)


def test_killed_cluster_container_fails_the_run_saying_so(tmp_path, client, start_long_run):
    """The container holding a cluster's namespace is the backend's; its loss is reported as what it is."""
    before = snapshot_all()
    out = tmp_path / "docker-holder"
    proc = start_long_run(out)
    wait_for_steps(out, 0, 2, proc)
    client.containers.get(f"{run_key_of(out)}-c1").kill()
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, output
    assert "Traceback" not in output, output
    failure = summary_of(out)["failure"]
    # The holder's death also kills its ranks; either way the run fails cleanly, naming what went.
    assert "cluster 1" in failure or "rank 1" in failure, failure
    assert_nothing_left(client, before, out)


def test_ctrl_c_removes_every_container_and_the_network(tmp_path, client, start_long_run):
    before = snapshot_all()
    out = tmp_path / "docker-ctrl-c"
    proc = start_long_run(out)
    wait_for_steps(out, 0, 2, proc)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    summary = summary_of(out)
    assert summary["status"] == "failed" and "SIGINT" in summary["failure"]
    assert_nothing_left(client, before, out)


def test_cleanup_removes_what_a_killed_harness_left(tmp_path, client, start_long_run):
    """SIGKILL gives the harness no chance to tear down, and its ranks live on in their containers."""
    before = snapshot_all()
    out = tmp_path / "docker-orphans"
    proc = start_long_run(out)
    wait_for_steps(out, 0, 1, proc)
    run_key = run_key_of(out)
    assert cleanup(run_key) == ([], [])  # the harness still lives: its run is not touched
    proc.kill()
    proc.communicate()
    left = sorted(docker_leftovers(client, run_key))
    assert left == sorted([f"{run_key}-{name}" for name in ("net", "c0", "c1", "r0", "r1")])
    containers, networks = cleanup(run_key)
    assert networks == [f"{run_key}-net"] and sorted(containers + networks) == left
    assert_nothing_left(client, before, out)
    # The backend's cleanup removes containers and networks; the dead run's lock file and staging folder are
    # `harness cleanup`'s (harness/lock.py), which this test leaves no less clean than it found.
    report = cleanup_runs(run_key, [out.parent])
    assert report.containers == [] and report.partial_folders == [out.parent / f".{out.name}.partial"]
    assert owner_alive(run_key) is None


@pytest.mark.alone
@pytest.mark.usefixtures("client")
def test_same_seed_gives_the_same_losses_and_busbw_as_netns(tmp_path):
    """At 500 Mbit/s both backends are bound by the shaper and send the same frames (470.5 and 463.3 Mbit/s). At
    1 Gbit/s two busy cores set the busbw instead (a fresh-clone CI run: netns 0.824, docker 0.671 Gbit/s); at
    100 Mbit/s and below netns sends wire-sized frames and docker GSO ones (95.3 and 88.5 Mbit/s)."""
    runs = {}
    for backend in ("netns", "docker"):
        out = tmp_path / f"{backend}-seeded"
        result = harness(
            "run", "--backend", backend, "--profile", "500mbps", "--calibrate", "--steps", 10, "--seed", 7,
            *SMALL_RUN, "--out", out,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        runs[backend] = out
    for rank in (0, 1):
        netns, docker_ = step_losses(runs["netns"], rank), step_losses(runs["docker"], rank)
        assert len(netns) == len(docker_) == 10
        assert netns == pytest.approx(docker_, abs=1e-5)
    busbw = {backend: summary_of(out)["link_busbw_bps"] for backend, out in runs.items()}
    print(f"busbw at 500 Mbit/s: netns {busbw['netns'] / 1e6:.1f}, docker {busbw['docker'] / 1e6:.1f} Mbit/s")
    assert busbw["docker"] == pytest.approx(busbw["netns"], rel=0.10)


@pytest.mark.usefixtures("client")
@pytest.mark.parametrize(
    ("env", "fix"),
    [
        ({"DOCKER_HOST": "unix:///nonexistent/docker.sock"}, "start one"),
        ({"HARNESS_DOCKER_IMAGE": "harness-worker:absent"}, "scripts/dev-image.sh"),
    ],
)
def test_missing_engine_or_image_is_one_sentence_naming_the_fix(tmp_path, env, fix):
    result = harness("run", *DOCKER, "--steps", 1, "--out", tmp_path / "never", env=env)
    assert result.returncode == 2
    assert fix in result.stdout + result.stderr and "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "never").exists()


def test_gpus_choose_one_gpu_per_rank():
    assert parse_gpus("auto", 2, nvidia_runtime=False) == [None, None]
    assert parse_gpus("auto", 2, nvidia_runtime=True) == ["0", "1"]
    assert parse_gpus("none", 2, nvidia_runtime=True) == [None, None]
    assert parse_gpus("3,1,2", 2, nvidia_runtime=True) == ["3", "1"]
    with pytest.raises(UserError, match="one GPU per rank"):
        parse_gpus("0", 2, nvidia_runtime=True)
    with pytest.raises(UserError, match="not understood"):
        parse_gpus("gpu0", 2, nvidia_runtime=True)
