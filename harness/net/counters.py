"""The kernel's interface counters: the bytes that really crossed a link.

Read through netlink (IFLA_STATS64) in the namespace that holds the interface; they count every byte on the wire,
headers included.
"""

from __future__ import annotations

from pyroute2 import IPRoute


def interface_counters(ip: IPRoute, ifname: str) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of `ifname` as the kernel counts them, seen through `ip` (an IPRoute or NetNS)."""
    (link,) = ip.get_links(ifname=ifname)
    stats = link.get_attr("IFLA_STATS64")
    return stats["tx_bytes"], stats["rx_bytes"]


def received_bytes(ip: IPRoute, indexes: list[int]) -> int:
    """The rx_bytes of the interfaces with these indexes, summed: one netlink request per interface (filtering by
    name dumps and decodes every interface of the namespace)."""
    return sum(link.get_attr("IFLA_STATS64")["rx_bytes"] for link in ip.get_links(*indexes))


class LinkCounter:
    """Bytes this namespace has sent (and received) on its uplink; read by the worker inside the cluster's
    namespace."""

    def __init__(self, ifname: str):
        self.ifname = ifname
        self._ip = IPRoute()

    def tx_bytes(self) -> int:
        return interface_counters(self._ip, self.ifname)[0]

    def rx_bytes(self) -> int:
        return interface_counters(self._ip, self.ifname)[1]

    def close(self) -> None:
        self._ip.close()


def tcp_counters() -> dict[str, int]:
    """This network namespace's TCP segment counters (/proc/self/net/snmp: OutSegs, RetransSegs, ...).

    Every rank of a cluster shares the namespace, so a stage-0 rank's difference over training is the cluster's.
    Retransmitted segments cross the link again, and the wire counters count them: they explain wire bytes above
    the method's payload.
    """
    with open("/proc/self/net/snmp") as snmp:
        return parse_tcp_snmp(snmp.read())


def parse_tcp_snmp(text: str) -> dict[str, int]:
    """The Tcp: lines of /proc/net/snmp (a header line of names, then one of values) as a mapping."""
    lines = [line.split() for line in text.splitlines() if line.startswith("Tcp:")]
    names, values = lines[0][1:], lines[1][1:]
    return {name: int(value) for name, value in zip(names, values, strict=True)}
