"""Network profiles: netem_profiles/*.yaml, the user's own YAML, or a tcconfig JSON file -> a validated Profile.

What the keys mean, and how the emulation realises them, is harness/net/link.py's; this module finds and reads
profiles, and refuses a rate this machine cannot shape faithfully.
"""

from __future__ import annotations

import os
from pathlib import Path

from harness.errors import read_yaml
from harness.net.link import LinkSpec, Profile, ProfileError, SiteLink, parse_rate_bps
from harness.net.site_rates import SiteRateDraw
from harness.net.trace import check_rows, load_trace, max_rate_bps, with_first_row
from harness.net.tracepoints import LinkTrace
from harness.units import format_rate

PROFILE_DIR = Path(__file__).resolve().parents[2] / "netem_profiles"

# tbf holds ~95% of the set rate up to ~1.5 Gbit/s per core here (ARCHITECTURE.md, "Measured limits"); above that
# the CPU, not the qdisc, sets the rate and the benchmark would silently measure the wrong link. Override with
# HARNESS_MAX_RATE.
SHAPEABLE_BPS_PER_CORE = 1.5e9
_PROFILE_KEYS = {"description", "inter_cluster", "intra_cluster", "sites", "site_rates", "trace"}


def known_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name_or_path: str) -> Profile:
    """A profile by name (netem_profiles/NAME.yaml), by a path to the user's own YAML file, or by a path to a
    tcconfig settings file (``*.json``, what ``tcshow`` prints; harness/net/tcconfig.py)."""
    path = Path(name_or_path)
    if path.suffix.lower() == ".json":
        from harness.net.tcconfig import load_tcconfig  # lazily: `harness --help` imports nothing of it

        return load_tcconfig(name_or_path)
    if path.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if _is_dir(path):
            raise _folder_error(name_or_path)
        if not _is_file(path):
            raise ProfileError(
                f"profile file {name_or_path} does not exist; pass a YAML file or a profile name (harness profiles "
                "list names them)"
            )
    else:
        path = PROFILE_DIR / f"{name_or_path}.yaml"
        if not _is_file(path):
            if _is_dir(Path(name_or_path)):
                raise _folder_error(name_or_path)
            raise ProfileError(
                f"unknown profile {name_or_path!r}; known profiles: {', '.join(known_profiles())} "
                "(or pass a path to your own YAML)"
            )
    data = read_yaml(path, "profile", ProfileError)
    if not isinstance(data, dict):
        raise ProfileError(f"profile {path} must be a YAML mapping with keys {sorted(_PROFILE_KEYS)}")
    unknown = set(data) - _PROFILE_KEYS
    if unknown:
        raise ProfileError(f"profile {path} has unknown keys {sorted(unknown)}; allowed: {sorted(_PROFILE_KEYS)}")
    sites = data.get("sites") or {}
    trace = _trace(data, path)
    link_yaml = data.get("inter_cluster")
    if trace is not None:
        if sites or "site_rates" in data:
            raise ProfileError(
                f"{path.name} has a trace and sites; a trace replays every site's link alike, so remove one of them"
            )
        link_yaml = with_first_row(link_yaml, trace, path.name)
    inter_cluster = LinkSpec.from_yaml(link_yaml, f"{path.name}: inter_cluster")
    if trace is not None:
        check_rows(inter_cluster, trace, path.name)
    # YAML reads `true:` as a bool, which Python counts as an int: refused, or the workers get int("True").
    if not isinstance(sites, dict) or not all(type(k) is int and k >= 0 for k in sites):
        raise ProfileError(
            f"{path.name}: sites must map site numbers (0, 1, ...) to their links, e.g. sites: {{1: {{rate: 100mbit}}}}"
        )
    draw = SiteRateDraw.from_yaml(data["site_rates"], f"{path.name}: site_rates") if "site_rates" in data else None
    if draw is not None:
        sites = {**{site: {"rate": f"{rate}bit"} for site, rate in draw.rates_bps().items()}, **sites}
    return Profile(
        name=path.stem,
        description=str(data.get("description", "")),
        inter_cluster=inter_cluster,
        intra_cluster=LinkSpec.from_yaml(data.get("intra_cluster"), f"{path.name}: intra_cluster"),
        source=str(path),
        sites={
            site: SiteLink.from_yaml(link, inter_cluster, f"{path.name}: sites: {site}")
            for site, link in sorted(sites.items())
        },
        trace=trace,
        site_draw=draw.to_dict() if draw else None,
    )


def _trace(data: dict, path: Path) -> LinkTrace | None:
    """The profile's `trace: FILE` (harness/net/trace.py), FILE relative to the profile's folder or absolute."""
    if "trace" not in data:
        return None
    if not isinstance(data["trace"], str) or not data["trace"].strip():
        raise ProfileError(f"{path.name}: trace must name a CSV file, e.g. trace: traces/mine.csv")
    return load_trace(path.parent / data["trace"].strip(), f"{path.name}: trace")


def _folder_error(name_or_path: str) -> ProfileError:
    return ProfileError(
        f"profile {name_or_path} is a folder; pass a profile YAML file or one of: {', '.join(known_profiles())}"
    )


def _is_file(path: Path) -> bool:
    # Path.is_file raises on a name too long for the file system; such a file does not exist either.
    try:
        return path.is_file()
    except OSError:
        return False


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def max_shapeable_rate_bps() -> float:
    override = os.environ.get("HARNESS_MAX_RATE")
    if override:
        try:
            return parse_rate_bps(override, tbf=False)
        except ProfileError as err:
            raise ProfileError(f"HARNESS_MAX_RATE: {err}") from None
    return SHAPEABLE_BPS_PER_CORE * (os.cpu_count() or 1)


def check_shapeable(profile: Profile) -> None:
    """Refuse a rate this machine's CPUs cannot push through a veth, so the link is really the bottleneck."""
    ceiling = max_shapeable_rate_bps()
    links = [("inter_cluster", profile.inter_cluster), ("intra_cluster", profile.intra_cluster)]
    for site, link in sorted(profile.sites.items()):
        links += [(f"site {site}'s uplink", link.up), (f"site {site}'s downlink", link.down)]
    if profile.trace is not None and max_rate_bps(profile.trace) is not None:
        links.append(("its trace's fastest row", LinkSpec(rate_bps=max_rate_bps(profile.trace))))
    for which, spec in links:
        if spec.rate_bps is not None and spec.rate_bps > ceiling:
            raise ProfileError(
                f"profile {profile.name!r} asks for {format_rate(spec.rate_bps)} on {which}, more than this "
                f"machine can shape faithfully (~{format_rate(ceiling)} with {os.cpu_count()} cores); use a slower "
                "profile or set HARNESS_MAX_RATE if you have measured that your machine keeps up"
            )


def profiles_table_rows() -> list[dict]:
    """One row per shipped profile, for `harness profiles list`: rate, RTT, jitter and loss side by side.

    Keys: name, rate (e.g. "1 Gbit/s", or "unshaped"), rate_bps (int or None), rtt (e.g. "40 ms", "-" without
    delay), rtt_ms, jitter ("+- 2 ms" on the round trip, or "-"), jitter_ms (one-way), loss ("1%" one-way, "3.85%
    GE" for a loss model's stationary rate, or "-"), loss_pct, description.
    """
    rows = []
    for name in known_profiles():
        profile = load_profile(name)
        link = profile.inter_cluster
        rows.append(
            {
                "name": name,
                "rate": format_rate(link.rate_bps) if link.rate_bps is not None else "unshaped",
                "rate_bps": link.rate_bps,
                "rtt": f"{link.rtt_ms:g} ms" if link.delay_ms else "-",
                "rtt_ms": link.rtt_ms,
                "jitter": f"+- {2 * link.jitter_ms:g} ms" if link.jitter_ms else "-",
                "jitter_ms": link.jitter_ms,
                "loss": f"{link.loss_pct:g}%" if link.loss_pct else _bursty_loss(link),
                "loss_pct": link.loss_pct,
                "description": profile.description,
            }
        )
    return rows


def _bursty_loss(link: LinkSpec) -> str:
    """A loss model's stationary rate, e.g. "3.85% GE" (Gilbert-Elliott); "-" without one."""
    return f"{100 * link.loss_fraction:.3g}% GE" if link.loss_model is not None else "-"
