"""`harness doctor`: what this machine can do for the harness, probed, not assumed."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from harness.net.delayline import TUN_DEVICE, tun_unavailable_reason
from harness.net.profiles import max_shapeable_rate_bps
from harness.net.shaping import probe_qdiscs
from harness.units import format_rate
from harness.userns import user_namespaces_work


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    meaning: str


def _docker_engine() -> tuple[bool, str, bool]:
    """(engine reachable, detail, nvidia runtime present)."""
    try:
        import docker
    except ImportError:
        return False, "the docker SDK is not installed (pip install 'harness[docker]')", False
    try:
        client = docker.from_env(timeout=3)
        info = client.info()
    except Exception as err:  # the SDK raises several unrelated types when no engine answers
        return False, f"engine unreachable ({type(err).__name__})", False
    runtimes = info.get("Runtimes", {})
    return True, f"engine {info.get('ServerVersion', '?')}", "nvidia" in runtimes


def _gpus() -> list[str]:
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def diagnose() -> list[Check]:
    return [*_privileges(), *_link_emulation(), *_ceilings(), *_devices()]


def _privileges() -> list[Check]:
    root = os.geteuid() == 0
    userns = user_namespaces_work()
    tools = [t for t in ("unshare", "nsenter") if shutil.which(t) is None]
    return [
        Check(
            "privileges",
            root or userns,
            "root" if root else ("user namespaces" if userns else "neither root nor user namespaces"),
            "the netns backend can build clusters"
            if root or userns
            else "the netns backend cannot run: use root or enable unprivileged user namespaces",
        ),
        Check(
            "util-linux",
            not tools,
            "unshare and nsenter found" if not tools else f"missing: {', '.join(tools)}",
            "needed to enter namespaces" if not tools else "install util-linux",
        ),
    ]


def _link_emulation() -> list[Check]:
    qdiscs = probe_qdiscs(os.geteuid() != 0)
    # Opened as the user who runs: a device that exists but only root may open fails the delay line all the same.
    tun_reason = tun_unavailable_reason()
    tun = tun_reason is None
    return [
        Check(
            "tbf",
            qdiscs["tbf"],
            "sch_tbf",
            "rate-only profiles work" if qdiscs["tbf"] else "no rate shaping: only the 'unshaped' profile works",
        ),
        Check("htb", qdiscs["htb"], "sch_htb", "available (the harness shapes with tbf)"),
        Check(
            "netem",
            qdiscs["netem"],
            "sch_netem",
            "link emulator for delay, jitter and loss (--link-emulator auto picks it)"
            if qdiscs["netem"]
            else "absent: delay, jitter and loss go through the userspace delay line (modprobe sch_netem for netem)",
        ),
        Check(
            "delay line",
            tun,
            f"TUN/TAP ({TUN_DEVICE}, opened read-write)" if tun else f"TUN/TAP ({TUN_DEVICE}) not usable by this user",
            ("userspace link emulator available (--link-emulator userspace" + (")" if qdiscs["netem"] else "; auto)"))
            if tun
            else f"no userspace delay line: {tun_reason}",
        ),
        Check(
            "ifb",
            qdiscs["ifb"],
            "IFB devices",
            "ingress redirection possible (not needed: both veth ends are shaped)",
        ),
    ]


def _ceilings() -> list[Check]:
    return [
        Check(
            "rate ceiling",
            True,
            f"~{format_rate(max_shapeable_rate_bps())} ({os.cpu_count()} cores)",
            "faster profiles are refused: the CPU, not the qdisc, would set the rate",
        ),
        Check(
            "cluster ceiling",
            True,
            f"{os.cpu_count()} ranks (clusters x stages) on {os.cpu_count()} cores",
            "beyond it ranks share cores and compute, not the link, may set the pace; runs warn before they start",
        ),
    ]


def _devices() -> list[Check]:
    docker_ok, docker_detail, nvidia = _docker_engine()
    gpus = _gpus()
    return [
        Check(
            "docker",
            docker_ok,
            docker_detail,
            "--backend docker can run" if docker_ok else "--backend docker is unavailable",
        ),
        Check(
            "nvidia runtime",
            nvidia,
            "present" if nvidia else "absent",
            "containers can get GPUs" if nvidia else "docker workers run on CPU",
        ),
        Check(
            "GPUs",
            bool(gpus),
            ", ".join(gpus) or "torch sees none",
            "workers use NCCL on CUDA" if gpus else "workers use gloo on CPU",
        ),
    ]
