"""tcconfig interop: a profile's inter-cluster link as tcconfig's settings file, and such a file as a profile.

tcconfig (https://github.com/thombashi/tcconfig, pinned here as 0.30.x; `pip install -e ".[tcconfig]"`) shapes real
hosts: ``tcset --import-setting FILE`` applies a settings file and ``tcshow DEVICE`` prints one, in this format::

    {"eth0": {"outgoing": {"protocol=ip": {"rate": "1Gbps", "delay": "20.0ms", "delay-distro": "1.0ms",
                                           "loss": "1%"}},
              "incoming": {}}}

Full or half: the harness emulates each cluster's access link in both directions, so each of its two hops carries
half of the one-way delay (LinkSpec.hop_*). A real deployment instead shapes each site's NIC egress once: a packet
from site A to site B crosses A's egress only, so every host applies the profile's FULL one-way values to its
egress (outgoing) and nothing to ingress. Two hosts that each delay their egress by `delay` see `delay` one way and
RTT = 2 x delay, lose `loss` per direction, and send at `rate` each way. This is what `export_tcconfig` writes, for
every host of every site (the intra-cluster link is the site's real LAN and is not shaped).

What does not carry over, either way:

- the `queue` (tbf's limit) has no tcconfig setting; an export leaves it out, a load takes the default. tcconfig
  shapes the rate with htb; a non-default `burst` is exported as htb's ``burst`` (bytes).
- netem, which tcconfig drives, lets jitter reorder packets, and tcset draws the jitter from a normal distribution
  (``delay-distro`` is its spread) where the harness draws uniformly from delay +- jitter. A jittered profile is
  exported only when it says ``reorder: true``; a loaded file with ``delay-distro`` gets ``reorder: true``.
- A profile's `sites` (one site's own access link) are refused: the file is one device's settings, and every host
  of every site applies the same one.
- A loss model (bursty loss, harness/net/lossmodel.py) is refused: tcconfig 0.30 has no setting for netem's
  ``loss gemodel``.
- Egress shaping alone does not hold incast (ARCHITECTURE.md, "Measured limits"); the emulation shapes both ends.

Loading refuses what the harness cannot express (incoming shaping, network or port filters, several devices or
filters, corruption, duplication, reordering percentages, netem's packet limit, unknown keys or units), each with
one sentence naming what to remove. Nothing here imports tcconfig: only the tests run its parser.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import TextIO

from harness.net.link import LinkSpec, Profile, ProfileError, check_burst, default_burst_bytes, parse_rate_bps

# tcconfig's rate units (humanreadable.BitsPerSecond): decimal K/M/G/T and binary Ki/Mi/Gi/Ti, case-insensitive
# first letter, "bps" or "bit/s".
_RATE_SCALE = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}
_RATE = re.compile(r"([0-9]*\.?[0-9]+)\s*(k|m|g|t|ki|mi|gi|ti)?(?:bps|bits?/s)", re.IGNORECASE)
# tcconfig's times (humanreadable.Time, the units a link can use); a bare number is milliseconds, as in tcset.
_TIME_SCALE = {
    "": 1.0,
    "ms": 1.0,
    "msec": 1.0,
    "msecs": 1.0,
    "us": 1e-3,
    "usec": 1e-3,
    "usecs": 1e-3,
    "s": 1e3,
    "sec": 1e3,
    "secs": 1e3,
}
_TIME = re.compile(r"(-?[0-9]*\.?[0-9]+)\s*([a-z]*)", re.IGNORECASE)
_PERCENT = re.compile(r"([0-9]*\.?[0-9]+)\s*%?")
# Settings a tcshow of a harness-exported link prints and load_tcconfig understands.
_SETTINGS = {"rate", "delay", "delay-distro", "loss", "burst"}
# Printed by tcshow but not a setting (the kernel's filter handle).
_IGNORED = {"filter_id"}
# netem's default queue limit: tc (and so tcshow) prints it on every netem qdisc.
NETEM_DEFAULT_LIMIT = 1000
_UNSUPPORTED = {
    "corrupt": "packet corruption",
    "duplicate": "packet duplication",
    "reorder": "a reordering percentage",
    "reordering": "a reordering percentage",
    "delay-distribution": "a delay distribution",
}


def export_tcconfig(profile: Profile, device: str = "eth0", allow_reorder: bool = False) -> dict:
    """`profile`'s inter-cluster link as the tcconfig settings ONE host applies to its NIC `device`: full one-way
    values on egress, none on ingress (module docstring). The intra-cluster link is not exported. A jittered link
    without `reorder: true` is refused unless `allow_reorder` (then netem will reorder where the profile does not)."""
    if profile.sites:
        site = min(profile.sites)
        raise ProfileError(
            f"profile {profile.name!r} gives site {site} its own link, which a tcconfig file (one device per host, the "
            "same settings on every host) cannot hold; export a copy of the profile without `sites` for the other "
            f"hosts and one whose inter_cluster link is site {site}'s for that site's hosts"
        )
    if profile.trace is not None:
        raise ProfileError(
            f"profile {profile.name!r} replays a trace, which a tcconfig file (one fixed rate and delay per device) "
            "cannot hold; export a profile without `trace`"
        )
    link = profile.inter_cluster
    if link.loss_model is not None:
        raise ProfileError(
            f"profile {profile.name!r} has bursty loss (a loss model), for which tcconfig has no setting; export a "
            f"copy of the profile with its stationary rate as a plain loss (loss: {100 * link.loss_fraction:.3g}%), "
            "which loses as many packets but not in bursts"
        )
    if link.jitter_ms and not link.reorder and not allow_reorder:
        raise ProfileError(
            f"profile {profile.name!r} has jitter without reorder: true, but netem (which tcconfig drives) reorders "
            "jittered packets; set reorder: true in a copy of the profile, drop the jitter, or allow the reordering"
        )
    settings: dict[str, object] = {}
    if link.rate_bps is not None:
        settings["rate"] = format_tcconfig_rate(link.rate_bps)
        if link.burst_bytes != default_burst_bytes(link.rate_bps):
            settings["burst"] = link.burst_bytes
    if link.delay_ms:
        settings["delay"] = format_tcconfig_time(link.delay_ms)
    if link.jitter_ms:
        settings["delay-distro"] = format_tcconfig_time(link.jitter_ms)
    if link.loss_pct:
        settings["loss"] = f"{link.loss_pct:g}%"
    return {device: {"outgoing": {"protocol=ip": settings} if settings else {}, "incoming": {}}}


def write_tcconfig(
    profile: Profile, out: str | Path | TextIO = "-", device: str = "eth0", allow_reorder: bool = False
) -> dict:
    """Export `profile` to `out`: a path, "-" for stdout, or an open text file, as indented JSON. Returns the
    settings written."""
    settings = export_tcconfig(profile, device, allow_reorder)
    text = json.dumps(settings, indent=4) + "\n"
    if out == "-":
        sys.stdout.write(text)
    elif isinstance(out, (str, Path)):
        Path(out).write_text(text)
    else:
        out.write(text)
    return settings


def format_tcconfig_rate(bps: int) -> str:
    """The largest decimal unit that states `bps` exactly, as tcshow prints rates: 1Gbps, 250Kbps, 1500Mbps."""
    for unit, scale in (("Tbps", 10**12), ("Gbps", 10**9), ("Mbps", 10**6), ("Kbps", 10**3)):
        if bps % scale == 0:
            return f"{bps // scale}{unit}"
    return f"{bps}bps"


def format_tcconfig_time(ms: float) -> str:
    """Milliseconds with at least one decimal, as tcshow prints netem times: 20.0ms, 0.5ms, 2.25ms."""
    text = f"{ms:.3f}".rstrip("0")
    return f"{text}0ms" if text.endswith(".") else f"{text}ms"


def load_tcconfig(path: str | Path) -> Profile:
    """A tcconfig settings file (what ``tcshow`` prints, ``tcset --import-setting`` reads) as a profile: its one
    device's outgoing settings become the inter-cluster link; the profile is named after the file's stem."""
    path = Path(path)
    where = f"tcconfig file {path}"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ProfileError(f"{where} does not exist; pass a tcconfig JSON file (what tcshow prints)") from None
    except IsADirectoryError:
        raise ProfileError(f"{where} is a folder; pass a tcconfig JSON file (what tcshow prints)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ProfileError(f"{where} cannot be read ({err}); pass a readable tcconfig JSON file") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ProfileError(f"{where} is not valid JSON at line {err.lineno}; fix the syntax") from None
    if not isinstance(data, dict) or not data:
        raise ProfileError(f'{where} must be a JSON object of one device, e.g. {{"eth0": {{"outgoing": {{...}}}}}}')
    if len(data) > 1:
        raise ProfileError(
            f"{where} sets {len(data)} devices ({', '.join(map(str, data))}); keep one, the harness emulates one link"
        )
    device, table = next(iter(data.items()))
    where = f"{where}, device {device}"
    if not isinstance(table, dict):
        raise ProfileError(f'{where} must map to {{"outgoing": {{...}}, "incoming": {{}}}}')
    unknown = set(table) - {"outgoing", "incoming"}
    if unknown:
        raise ProfileError(
            f"{where} has unknown keys {sorted(unknown)}; keep only 'outgoing' (and an empty 'incoming')"
        )
    if table.get("incoming"):
        raise ProfileError(
            f"{where} shapes incoming traffic, which the harness cannot express (each site shapes its egress); "
            "remove the incoming settings"
        )
    outgoing = table.get("outgoing") or {}
    if not isinstance(outgoing, dict):
        raise ProfileError(f'{where}: outgoing must map a filter such as "protocol=ip" to its settings')
    if len(outgoing) > 1:
        raise ProfileError(
            f'{where} has {len(outgoing)} outgoing filters ({"; ".join(outgoing)}); keep one "protocol=ip" filter, '
            "the harness shapes the whole link"
        )
    link = LinkSpec()
    if outgoing:
        rule, settings = next(iter(outgoing.items()))
        _check_filter(rule, where)
        link = _link_from_settings(settings, f"{where}, outgoing {rule!r}")
    return Profile(
        name=path.stem,
        description=f"tcconfig settings for {device} from {path.name}",
        inter_cluster=link,
        intra_cluster=LinkSpec(),
        source=str(path),
    )


def _check_filter(rule: str, where: str) -> None:
    items = [item.strip() for item in str(rule).split(",") if item.strip()]
    pairs = dict(item.split("=", 1) if "=" in item else (item, "") for item in items)
    if pairs != {"protocol": "ip"}:
        raise ProfileError(
            f"{where} shapes only traffic matching {rule!r}, but the harness shapes the whole link; remove the "
            'network and port filters (keep "protocol=ip")'
        )


def _link_from_settings(settings: object, where: str) -> LinkSpec:
    if not isinstance(settings, dict):
        raise ProfileError(f"{where} must map setting names (rate, delay, delay-distro, loss) to values")
    for key, value in settings.items():
        if key in _UNSUPPORTED and _percent_or_text_nonzero(value):
            raise ProfileError(f"{where} sets {key} ({_UNSUPPORTED[key]}), which the harness cannot emulate; remove it")
        if key == "limit" and str(value).strip() not in ("", str(NETEM_DEFAULT_LIMIT)):
            raise ProfileError(
                f"{where} sets netem's packet limit to {value}, which the harness cannot set; remove 'limit'"
            )
        if key not in _SETTINGS | _IGNORED | set(_UNSUPPORTED) | {"limit"}:
            raise ProfileError(
                f"{where} has the unknown setting {key!r}; remove it (understood: {', '.join(sorted(_SETTINGS))})"
            )
    kwargs: dict[str, object] = {}
    if "rate" in settings:
        kwargs["rate_bps"] = _rate_bps(settings["rate"], where)
    if "burst" in settings:
        burst = settings["burst"]
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
            raise ProfileError(f"{where}: burst {burst!r} must be a whole number of bytes, e.g. 250000")
        check_burst(kwargs.get("rate_bps"), burst, f"{burst}b", f"{where}: ")
        kwargs["burst_bytes"] = burst
    delay = _time_ms(settings["delay"], "delay", where) if "delay" in settings else 0.0
    jitter = _time_ms(settings["delay-distro"], "delay-distro", where) if "delay-distro" in settings else 0.0
    if "loss" in settings:
        kwargs["loss_pct"] = _loss_pct(settings["loss"], where)
    # netem reorders jittered packets: the file means a link that reorders.
    try:
        link = LinkSpec(delay_ms=delay, jitter_ms=jitter, reorder=bool(jitter), **kwargs)
    except ProfileError as err:
        raise ProfileError(f"{where}: {err}") from None
    link.check(where)
    return link


def _percent_or_text_nonzero(value: object) -> bool:
    match = _PERCENT.fullmatch(str(value).strip())
    return not (match and float(match.group(1)) == 0)


def _rate_bps(value: object, where: str) -> int:
    match = _RATE.fullmatch(str(value).strip())
    if not match:
        raise ProfileError(
            f"{where}: rate {value!r} is not in a unit tcconfig writes; use e.g. 1Gbps, 100Mbps or 500Kbps"
        )
    bps = float(match.group(1)) * _RATE_SCALE[(match.group(2) or "").lower()]
    try:
        return parse_rate_bps(f"{round(bps)}bit")
    except ProfileError as err:
        raise ProfileError(f"{where}: {err}") from None


def _time_ms(value: object, key: str, where: str) -> float:
    match = _TIME.fullmatch(str(value).strip())
    if not match or match.group(2).lower() not in _TIME_SCALE:
        raise ProfileError(f"{where}: {key} {value!r} is not in a unit the harness takes; use e.g. 20.0ms or 500us")
    return float(match.group(1)) * _TIME_SCALE[match.group(2).lower()]


def _loss_pct(value: object, where: str) -> float:
    match = _PERCENT.fullmatch(str(value).strip())
    if not match:
        raise ProfileError(f"{where}: loss {value!r} is not understood; use a percentage such as 1% or 0.01%")
    pct = float(match.group(1))
    if not 0 <= pct < 100:
        raise ProfileError(f"{where}: loss {value!r} must be a percentage in [0, 100)")
    return pct
