"""LinkSpec -> qdiscs on one interface, through netlink (pyroute2).

A rate alone becomes a tbf root qdisc. Delay, jitter or loss with the netem link emulator: netem becomes the root
and tbf its child, so packets are delayed and then rate-limited; netem gets the link's per-hop share (half the
profile's one-way delay and jitter, the loss that composes over two hops to the profile's). Kernels without
sch_netem are detected up front (see `probe_qdiscs`); there the userspace delay line (harness/net/delayline.py) takes
delay, jitter and loss, and this module sets only the rate. A loss model (bursty loss, harness/net/lossmodel.py) is
refused with netem: pyroute2's netem encoder sends no TCA_NETEM_LOSS attribute, so netem would run without it. Nothing
here degrades silently.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

from pyroute2 import IPRoute

from harness.net.link import LinkSpec, ProfileError

# qdisc kinds a profile may need, probed by creating each on a loopback inside a throwaway namespace.
PROBED_QDISCS = ("tbf", "htb", "netem")

_PROBE = r"""
import json
from pyroute2 import IPRoute
found = {}
with IPRoute() as ip:
    lo = ip.link_lookup(ifname="lo")[0]
    for kind, kwargs in [("tbf", dict(rate="1mbit", burst=16384, latency="50ms")), ("htb", dict(default=0)),
                         ("netem", dict(delay=1000))]:
        try:
            ip.tc("add", kind, lo, 0x10000, **kwargs)
            found[kind] = True
            ip.tc("del", index=lo, handle=0x10000, root=True)
        except Exception:
            found[kind] = False
    try:
        ip.link("add", ifname="probe-ifb", kind="ifb")
        found["ifb"] = True
    except Exception:
        found["ifb"] = False
print(json.dumps(found))
"""


@functools.cache
def probe_qdiscs(userns: bool) -> dict[str, bool]:
    """Which qdiscs (and IFB) this kernel offers, tested in a private network namespace that vanishes after."""
    prefix = ["unshare", "--net"] + (["--user", "--map-root-user"] if userns else [])
    try:
        out = subprocess.run(
            prefix + [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        return json.loads(out)
    except (subprocess.SubprocessError, OSError, json.JSONDecodeError):
        return {kind: False for kind in (*PROBED_QDISCS, "ifb")}


def _tbf_kwargs(spec: LinkSpec) -> dict:
    return {
        "rate": f"{spec.rate_bps}bit",
        "burst": spec.burst_bytes,
        "limit": spec.queue_bytes,
    }


def apply_link_spec(ip: IPRoute, ifname: str, spec: LinkSpec, netem: bool = False, one_hop: bool = False) -> list[dict]:
    """Shape egress of `ifname` (seen through `ip`, an IPRoute or NetNS) and return what was applied: the rate,
    and with `netem` the link's delay, jitter and loss (else another emulator adds them, or the profile has none):
    the per-hop share of a path of two such links, or all of it with `one_hop` (loopback, the intra-cluster link)."""
    if not spec.shaped:
        return []
    if netem and spec.loss_model is not None:
        # pyroute2's netem encoder has no TCA_NETEM_LOSS attribute: netem would run without the model, silently.
        raise ProfileError(
            "netem as the harness drives it (pyroute2) takes no loss model; use the userspace delay line "
            "(--link-emulator userspace) for bursty loss"
        )
    index = ip.link_lookup(ifname=ifname)[0]
    applied = []
    if netem and spec.needs_netem:
        options = {
            "delay": round((spec.delay_ms if one_hop else spec.hop_delay_ms) * 1000),
            "jitter": round((spec.jitter_ms if one_hop else spec.hop_jitter_ms) * 1000),
            "loss": spec.loss_pct if one_hop else spec.hop_loss_pct,
        }
        ip.tc("add", "netem", index, 0x10000, **options)
        applied.append({"dev": ifname, "kind": "netem", "handle": "1:", "parent": "root", **options})
        if spec.rate_bps is not None:
            ip.tc("add", "tbf", index, 0x100000, parent=0x10001, **_tbf_kwargs(spec))
            applied.append({"dev": ifname, "kind": "tbf", "handle": "10:", "parent": "1:1", **_tbf_kwargs(spec)})
    elif spec.rate_bps is not None:
        ip.tc("add", "tbf", index, 0x10000, **_tbf_kwargs(spec))
        applied.append({"dev": ifname, "kind": "tbf", "handle": "1:", "parent": "root", **_tbf_kwargs(spec)})
    return applied


def change_link_rate(ip: IPRoute, ifname: str, spec: LinkSpec, netem: bool = False) -> dict:
    """Change the rate of the tbf that `apply_link_spec(ip, ifname, spec, netem)` set, in place (packets queued in it
    stay); `spec` is the link at its new rate. Returns what was applied."""
    index = ip.link_lookup(ifname=ifname)[0]
    under_netem = netem and spec.needs_netem
    handle, parent = (0x100000, {"parent": 0x10001}) if under_netem else (0x10000, {})
    ip.tc("change", "tbf", index, handle, **parent, **_tbf_kwargs(spec))
    return {"dev": ifname, "kind": "tbf", "handle": "10:" if under_netem else "1:", **_tbf_kwargs(spec)}


def tbf_backlog_bytes(ip: IPRoute, ifname: str) -> int:
    """The bytes waiting in the tbf on `ifname` now (its qdisc statistics)."""
    index = ip.link_lookup(ifname=ifname)[0]
    (tbf,) = [msg for msg in ip.get_qdiscs(index) if msg.get_attr("TCA_KIND") == "tbf"]
    return tbf.get_attr("TCA_STATS")["backlog"]


def read_qdiscs(ip: IPRoute, ifname: str) -> list[dict]:
    """The qdiscs the kernel reports on `ifname`, for the results' record of what was really in force."""
    index = ip.link_lookup(ifname=ifname)[0]
    found = []
    for msg in ip.get_qdiscs(index):
        kind = msg.get_attr("TCA_KIND")
        entry = {
            "dev": ifname,
            "kind": kind,
            "handle": f"{msg['handle'] >> 16:x}:",
            "parent": "root" if msg["parent"] == 0xFFFFFFFF else f"{msg['parent'] >> 16:x}:{msg['parent'] & 0xFFFF:x}",
        }
        options = msg.get_attr("TCA_OPTIONS")
        if kind == "tbf" and options is not None:
            parms = options.get_attr("TCA_TBF_PARMS")
            if parms is not None:
                entry["rate_bps"] = parms["rate"] * 8
                entry["limit_bytes"] = parms["limit"]
        found.append(entry)
    return found
