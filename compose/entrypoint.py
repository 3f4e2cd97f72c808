#!/usr/bin/env python3
"""Entrypoint of a compose job's containers: shape this container's link with a named profile, write the run's
config.json, run the given command (torchrun), and take the shaping off again when it ends.

Environment (docker-compose.yml sets it): PROFILE (a name in netem_profiles/ or a YAML path); SHAPE_IFNAME, the
interface between the clusters (eth0 in a compose network, the host's NIC with network_mode: host); HARNESS_RUN_DIR;
the run's METHOD, MODEL, STEPS, SEED, CLUSTERS and STAGES. Needs NET_ADMIN. Every rank binds its collectives to
SHAPE_IFNAME, so nothing between the clusters bypasses the shaped link.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from pyroute2 import IPRoute

from harness.net.link import Profile
from harness.net.profiles import load_profile
from harness.net.shaping import apply_link_spec, read_qdiscs
from harness.run.config import RunConfig


def write_config(run_dir: Path, profile: Profile) -> None:
    """The worker's config.json. Every cluster writes the same bytes (the run key derives from the folder's name)
    and replaces the file atomically, since on one host the clusters share the folder."""
    config = RunConfig.build(
        os.environ.get("METHOD", "allreduce"),
        profile,
        clusters=int(os.environ.get("CLUSTERS", 2)),
        stages=int(os.environ.get("STAGES", 1)),
        backend="docker",
        model=os.environ.get("MODEL"),
        steps=int(os.environ["STEPS"]) if "STEPS" in os.environ else None,
        seed=int(os.environ["SEED"]) if "SEED" in os.environ else None,
    )
    run_key = "hx" + hashlib.sha256(run_dir.name.encode()).hexdigest()[:6]
    config = dataclasses.replace(config, run_key=run_key, run_id=run_dir.name)
    run_dir.mkdir(parents=True, exist_ok=True)
    staged = run_dir / f".config.json.{os.getpid()}"
    config.save(staged)
    staged.replace(run_dir / "config.json")


def shape(ifname: str, profile: Profile) -> list[str]:
    """Shape egress of `ifname` (the inter-cluster link) and of lo (the intra-cluster one); returns what was shaped."""
    shaped = []
    with IPRoute() as ip:
        for dev, spec in ((ifname, profile.inter_cluster), ("lo", profile.intra_cluster)):
            if apply_link_spec(ip, dev, spec):
                shaped.append(dev)
                print(f"harness-entrypoint: {profile.name} on {dev}: {read_qdiscs(ip, dev)}", flush=True)
    return shaped


def unshape(devices: list[str]) -> None:
    """Give the interfaces back their default qdisc (with network_mode: host they are the host's own)."""
    with IPRoute() as ip:
        for dev in devices:
            ip.tc("del", index=ip.link_lookup(ifname=dev)[0], root=True)


def main() -> int:
    if len(sys.argv) < 2:
        sys.exit("usage: harness-entrypoint COMMAND [ARG...]  (e.g. torchrun ... -m harness.run.worker --run-dir DIR)")
    ifname = os.environ.get("SHAPE_IFNAME", "eth0")
    profile = load_profile(os.environ.get("PROFILE", "1gbps"))
    write_config(Path(os.environ["HARNESS_RUN_DIR"]), profile)
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": ifname,
        "NCCL_SOCKET_IFNAME": ifname,
        "NCCL_P2P_DISABLE": "1",
        "NCCL_SHM_DISABLE": "1",
        "NCCL_IB_DISABLE": "1",
        "HARNESS_UPLINK": ifname,
    }
    shaped = shape(ifname, profile)
    try:
        child = subprocess.Popen(sys.argv[1:], env=env)
        # `docker stop` signals this process (PID 1): pass it on, so torchrun stops its ranks and the shaping is
        # removed below rather than left on a host NIC.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: child.send_signal(signum))
        return child.wait()
    finally:
        unshape(shaped)


if __name__ == "__main__":
    sys.exit(main())
