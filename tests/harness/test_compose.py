"""compose/: the compose files validate, the entrypoint shapes and unshapes, and a compose job really trains.

`docker-compose config` needs no engine; where docker-compose is not installed those checks skip with the reason.
The full job needs an engine too and runs on CPU: the GPU reservations are dropped and the development image stands
in for compose/Dockerfile's (no registry is reachable to pull its CUDA base here).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.userns import user_namespaces_work

REPO = Path(__file__).resolve().parents[2]
COMPOSE = [shutil.which("docker-compose") or "docker-compose"]
BASE = REPO / "compose" / "docker-compose.yml"
TWO_HOSTS = REPO / "compose" / "docker-compose.two-hosts.yml"
ENTRYPOINT = REPO / "compose" / "entrypoint.py"


def compose_config(*files: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose): compose files not validated")
    args = [arg for f in files for arg in ("-f", str(f))]
    return subprocess.run(
        [*COMPOSE, *args, "config"], capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=REPO
    )


def test_compose_file_runs_two_shaped_clusters_under_torchrun():
    result = compose_config(BASE)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert sorted(services) == ["cluster0", "cluster1"]
    for node_rank, name in enumerate(["cluster0", "cluster1"]):
        service = services[name]
        assert service["cap_add"] == ["NET_ADMIN"]
        assert service["entrypoint"] == ["harness-entrypoint"]
        assert service["environment"]["PROFILE"] == "1gbps"
        (devices,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices["driver"] == "nvidia" and devices["capabilities"] == ["gpu"]
        assert devices["device_ids"] == [str(node_rank)]  # one GPU per cluster (per rank with one stage)
        command = service["command"]
        assert command[0] == "torchrun" and f"--node-rank={node_rank}" in command
        assert "--master-addr=cluster0" in command and command[-1] == service["environment"]["HARNESS_RUN_DIR"]


def test_two_hosts_use_host_networking_and_insist_on_the_master_and_nic():
    result = compose_config(BASE, TWO_HOSTS, env={"MASTER_ADDR": "", "SHAPE_IFNAME": ""})
    assert result.returncode != 0 and "set MASTER_ADDR to host A's address" in result.stderr
    result = compose_config(BASE, TWO_HOSTS, env={"MASTER_ADDR": "10.1.2.3", "SHAPE_IFNAME": "ens5"})
    assert result.returncode == 0, result.stderr
    for service in yaml.safe_load(result.stdout)["services"].values():
        assert service["network_mode"] == "host"
        assert service["environment"]["SHAPE_IFNAME"] == "ens5"
        assert "--master-addr=10.1.2.3" in service["command"]


# Run inside a fresh network namespace: a stand-in eth0, the entrypoint around a probe, then what is left on eth0.
_DRIVER = """
import json, subprocess, sys
from pyroute2 import IPRoute
from harness.net.shaping import read_qdiscs
with IPRoute() as ip:
    ip.link("add", ifname="eth0", kind="veth", peer="peer0")
    for name in ("eth0", "peer0"):
        ip.link("set", index=ip.link_lookup(ifname=name)[0], state="up")
probe = (
    "import json, os; from pyroute2 import IPRoute; from harness.net.shaping import read_qdiscs; "
    "print(json.dumps({'qdiscs': read_qdiscs(IPRoute(), 'eth0'), 'ifname': os.environ['GLOO_SOCKET_IFNAME']}))"
)
inside = subprocess.run([sys.executable, sys.argv[1], sys.executable, "-c", probe], capture_output=True, text=True)
assert inside.returncode == 0, inside.stdout + inside.stderr
with IPRoute() as ip:
    print(json.dumps({"inside": json.loads(inside.stdout.splitlines()[-1]), "after": read_qdiscs(ip, "eth0")}))
"""


def test_entrypoint_shapes_eth0_writes_the_config_and_unshapes(tmp_path):
    if os.geteuid() != 0 and not user_namespaces_work():
        pytest.skip("needs root or user namespaces to give the entrypoint a network namespace of its own")
    unshare = ["unshare", "--net"] + ([] if os.geteuid() == 0 else ["--user", "--map-root-user"])
    run_dir = tmp_path / "compose-run"
    env = {**os.environ, "PROFILE": "100mbps", "STEPS": "30", "HARNESS_RUN_DIR": str(run_dir)}
    result = subprocess.run(
        [*unshare, sys.executable, "-c", _DRIVER, str(ENTRYPOINT)], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    assert [(q["kind"], q["rate_bps"]) for q in seen["inside"]["qdiscs"]] == [("tbf", 10**8)]
    assert seen["inside"]["ifname"] == "eth0"
    assert not [q for q in seen["after"] if q["kind"] == "tbf"]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["profile"]["name"] == "100mbps" and config["train"]["steps"] == 30 and config["clusters"] == 2


def _engine_reachable() -> bool:
    try:
        import docker

        docker.from_env(timeout=5).ping()
        return True
    except Exception:  # ImportError, or the SDK's several types for "nothing answers"
        return False


@pytest.mark.e2e
@pytest.mark.usefixtures("docker_engine_to_itself")
def test_compose_job_trains_on_cpu_with_the_dev_image(tmp_path):
    if os.geteuid() != 0 or not _engine_reachable():
        pytest.skip("needs root and a docker engine (install docker.io and start dockerd) to run the compose job")
    config = yaml.safe_load(compose_config(BASE, env={"STEPS": "20", "PROFILE": "100mbps"}).stdout)
    subprocess.run([REPO / "scripts" / "dev-image.sh"], check=True, capture_output=True)
    venv_bin = Path(sys.executable).parent
    for service in config["services"].values():
        del service["deploy"], service["build"]
        service["image"] = "harness-worker:dev"
        service["entrypoint"] = [sys.executable, str(ENTRYPOINT)]
        # What scripts/dev-image.sh's image needs at run time: the host's Python, packages and this repository.
        mounted = {"/usr", sys.base_prefix, sys.prefix, str(REPO)}
        service["volumes"] = [f"{p}:{p}:ro" for p in sorted(mounted)] + [f"{tmp_path}:/results:rw"]
        service["environment"]["PATH"] = f"{venv_bin}:/usr/bin:/bin"
    compose_file = tmp_path / "cpu.yml"
    compose_file.write_text(yaml.safe_dump(config))
    project = ["-p", f"hxcompose{secrets.token_hex(3)}", "-f", str(compose_file)]
    try:
        result = subprocess.run([*COMPOSE, *project, "up"], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.count("harness-entrypoint: 100mbps on eth0") == 2
    finally:
        subprocess.run([*COMPOSE, *project, "down"], capture_output=True, timeout=120)
    run_dir = tmp_path / "compose-run"
    ranks = [json.loads((run_dir / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1)]
    payload = sum(
        e.get("sync_payload_bytes", 0)
        for r in (0, 1)
        for e in map(json.loads, (run_dir / "events" / f"rank{r}.jsonl").read_text().splitlines())
    )
    assert 1.0 <= sum(rank["wire_bytes"] for rank in ranks) / payload < 1.10
    assert ranks[1]["final_val_loss"] < 5.0  # below the uniform-byte entropy ln 256 = 5.55 after 20 steps
