"""netem_profiles/*.yaml -> validated LinkSpecs: units, refusals with messages that name the fix, rate ceiling."""

import os
from pathlib import Path

import pytest

from harness.profiles import (
    PROFILE_DIR,
    LinkSpec,
    Profile,
    ProfileError,
    check_shapeable,
    format_rate,
    known_profiles,
    load_profile,
    max_shapeable_rate_bps,
    parse_loss_pct,
    parse_rate_bps,
    parse_size_bytes,
    parse_time_ms,
)

SHIPPED = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "netem_profiles").glob("*.yaml"))


@pytest.fixture
def two_cores(monkeypatch):
    """A deterministic rate ceiling: 2 cores and no override, whatever machine runs the tests."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("HARNESS_MAX_RATE", raising=False)


def write(tmp_path: Path, text: str, name: str = "mine.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --- shipped profiles -------------------------------------------------------------------------------------------


def test_known_profiles_are_the_shipped_files():
    assert PROFILE_DIR.is_dir()
    assert known_profiles() == SHIPPED
    assert {"unshaped", "10mbps", "100mbps", "500mbps", "1gbps", "10gbps", "wan-1gbps-20ms"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_profile_loads(name):
    profile = load_profile(name)
    assert profile.name == name
    assert profile.description
    assert Path(profile.source) == PROFILE_DIR / f"{name}.yaml"
    assert isinstance(profile.inter_cluster, LinkSpec) and isinstance(profile.intra_cluster, LinkSpec)
    # Shipped profiles shape only the slow link between sites.
    assert not profile.intra_cluster.shaped
    assert profile.inter_cluster.shaped == (name != "unshaped")


def test_unshaped_has_no_rate_and_needs_nothing():
    p = load_profile("unshaped")
    assert p.inter_cluster.rate_bps is None
    assert not p.inter_cluster.shaped and not p.needs_netem
    assert p.inter_cluster.describe() == "unshaped"


@pytest.mark.parametrize(
    ("name", "bps", "burst"),
    [
        # The shipped profiles take the rate-true default: 2 ms of line time, at least a 64 KiB GSO segment.
        ("10mbps", 10**7, 64 * 1024),
        ("100mbps", 10**8, 64 * 1024),
        ("500mbps", 5 * 10**8, 125_000),
        ("1gbps", 10**9, 250_000),
        ("10gbps", 10**10, 2_500_000),
    ],
)
def test_rate_profiles(name, bps, burst):
    p = load_profile(name)
    assert p.inter_cluster.rate_bps == bps
    assert isinstance(p.inter_cluster.rate_bps, int)
    assert p.inter_cluster.burst_bytes == burst
    assert not p.needs_netem
    assert p.inter_cluster.shaped


def test_wan_profile_needs_netem():
    p = load_profile("wan-1gbps-20ms")
    assert p.inter_cluster.rate_bps == 10**9
    assert p.inter_cluster.delay_ms == 20.0
    assert p.inter_cluster.jitter_ms == 1.0
    assert p.inter_cluster.needs_netem and p.needs_netem
    assert not p.intra_cluster.needs_netem
    assert "delay 20 ms +- 1 ms" in p.inter_cluster.describe()


def test_describe_and_format_rate():
    assert load_profile("1gbps").inter_cluster.describe() == "1 Gbit/s (burst 244 KiB = 2.0 ms)"
    assert format_rate(1.5e9) == "1.5 Gbit/s"
    assert format_rate(5e8) == "500 Mbit/s"
    assert format_rate(8e3) == "8 kbit/s"
    assert LinkSpec(loss_pct=0.5).describe() == "loss 0.5%"


def test_to_dict_round_trips():
    p = load_profile("wan-1gbps-20ms")
    d = p.to_dict()
    assert d["name"] == "wan-1gbps-20ms"
    assert LinkSpec(**d["inter_cluster"]) == p.inter_cluster
    assert LinkSpec(**d["intra_cluster"]) == p.intra_cluster


# --- units ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("1gbit", 10**9),
        ("500mbit", 5 * 10**8),
        ("1.5gbit", 15 * 10**8),
        ("800kbit", 800_000),
        ("8kbit", 8_000),
        ("1Gbit", 10**9),
        (" 100mbit ", 10**8),
        ("1tbit", 10**12),
    ],
)
def test_parse_rate(text, bps):
    assert parse_rate_bps(text) == bps
    assert isinstance(parse_rate_bps(text), int)


@pytest.mark.parametrize("text", ["0mbit", "7kbit", "0.001kbit"])
def test_rate_too_small_is_refused(text):
    with pytest.raises(ProfileError, match="use a larger rate"):
        parse_rate_bps(text)


@pytest.mark.parametrize("text", ["-1gbit", "100", 100, "1gbps", "100mbps", "fast", "", "1 g bit", "gbit"])
def test_rate_not_understood_lists_the_units(text):
    with pytest.raises(ProfileError) as err:
        parse_rate_bps(text)
    message = str(err.value)
    assert "not understood" in message
    assert "write a number with a unit" in message
    for unit in ("kbit", "mbit", "gbit"):
        assert unit in message


@pytest.mark.parametrize(
    ("text", "size"),
    [("256kb", 262144), ("64kb", 65536), ("1mb", 1024**2), ("1500b", 1500), ("16k", 16384), ("2m", 2 * 1024**2)],
)
def test_parse_size(text, size):
    assert parse_size_bytes(text) == size


@pytest.mark.parametrize("text", ["256", "256kib", "-1kb", "big"])
def test_bad_size_is_refused(text):
    with pytest.raises(ProfileError, match="256kb"):
        parse_size_bytes(text)


def test_zero_size_is_refused():
    with pytest.raises(ProfileError, match="positive"):
        parse_size_bytes("0kb")


@pytest.mark.parametrize(("text", "ms"), [("20ms", 20.0), ("500us", 0.5), ("1s", 1000.0), ("0.5ms", 0.5)])
def test_parse_time(text, ms):
    assert parse_time_ms(text) == pytest.approx(ms)


@pytest.mark.parametrize("text", ["20", "20 minutes", "-5ms", "soon"])
def test_bad_time_is_refused(text):
    with pytest.raises(ProfileError, match="20ms"):
        parse_time_ms(text)


@pytest.mark.parametrize(("text", "pct"), [("0.1%", 0.1), ("1%", 1.0), ("0%", 0.0), ("2", 2.0), (0.5, 0.5)])
def test_parse_loss(text, pct):
    assert parse_loss_pct(text) == pytest.approx(pct)


@pytest.mark.parametrize("text", ["100%", "150%"])
def test_loss_out_of_range_is_refused(text):
    with pytest.raises(ProfileError, match=r"\[0, 100\)"):
        parse_loss_pct(text)


@pytest.mark.parametrize("text", ["-1%", "lots", "1ms"])
def test_bad_loss_is_refused(text):
    with pytest.raises(ProfileError, match="0.1%"):
        parse_loss_pct(text)


# --- user profiles and their mistakes ---------------------------------------------------------------------------


def test_user_yaml_path(tmp_path):
    path = write(
        tmp_path,
        "description: my link\n"
        "inter_cluster:\n  rate: 250mbit\n  burst: 128kb\n  latency: 20ms\n  delay: 5ms\n  loss: 0.1%\n"
        "intra_cluster:\n  rate: 10gbit\n",
    )
    p = load_profile(path)
    assert p.name == "mine"
    assert p.description == "my link"
    assert p.source == path
    assert p.inter_cluster == LinkSpec(
        rate_bps=250 * 10**6, burst_bytes=128 * 1024, latency_ms=20.0, delay_ms=5.0, loss_pct=0.1
    )
    assert p.intra_cluster == LinkSpec(rate_bps=10**10)
    assert p.needs_netem


def test_user_yaml_without_yaml_suffix_is_a_path(tmp_path):
    path = write(tmp_path, "inter_cluster:\n  rate: 1gbit\n", name="link.txt")
    assert load_profile(path).inter_cluster.rate_bps == 10**9


def test_empty_links_are_unshaped(tmp_path):
    p = load_profile(write(tmp_path, "description: nothing\n"))
    assert p.inter_cluster == LinkSpec() and p.intra_cluster == LinkSpec()


@pytest.mark.parametrize("name", ["nope", "1gbit", "1GBPS"])
def test_unknown_profile_lists_the_known_ones(name):
    with pytest.raises(ProfileError) as err:
        load_profile(name)
    message = str(err.value)
    assert f"unknown profile {name!r}" in message
    for known in SHIPPED:
        assert known in message
    assert "path" in message


def test_missing_profile_file_lists_the_known_ones(tmp_path):
    with pytest.raises(ProfileError) as err:
        load_profile(str(tmp_path / "missing.yaml"))
    assert "does not exist" in str(err.value)
    assert all(known in str(err.value) for known in SHIPPED)


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("description: x\ninter_cluster:\n  rate: 1gbit\n burst: 256kb\n", 4),
        ("a: b: c\n", 1),
        ("description: x\ninter_cluster:\n  rate: [1gbit\n", 4),
    ],
)
def test_malformed_yaml_names_the_line(tmp_path, text, line):
    path = write(tmp_path, text)
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert str(err.value) == f"profile {path} is not valid YAML at line {line}; fix the syntax"


@pytest.mark.parametrize("text", ["- 1gbit\n", "just a string\n", ""])
def test_profile_must_be_a_mapping(tmp_path, text):
    with pytest.raises(ProfileError, match="must be a YAML mapping"):
        load_profile(write(tmp_path, text))


def test_unknown_top_level_keys_are_named(tmp_path):
    path = write(tmp_path, "description: x\ninter_clsuter:\n  rate: 1gbit\nspeed: fast\n")
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    message = str(err.value)
    assert "unknown keys ['inter_clsuter', 'speed']" in message
    assert "inter_cluster" in message and "intra_cluster" in message


def test_unknown_link_keys_are_named(tmp_path):
    path = write(tmp_path, "inter_cluster:\n  rate: 1gbit\n  bandwidth: 1gbit\n  dealy: 5ms\n")
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    message = str(err.value)
    assert "mine.yaml: inter_cluster has unknown keys ['bandwidth', 'dealy']" in message
    assert "'delay'" in message and "'rate'" in message


def test_link_must_be_a_mapping(tmp_path):
    with pytest.raises(ProfileError, match="intra_cluster must be a mapping"):
        load_profile(write(tmp_path, "intra_cluster: 1gbit\n"))


@pytest.mark.parametrize(
    ("link", "message"),
    [
        ("  rate: 100\n", "rate 100 is not understood"),
        ("  rate: 1gbps\n", "rate '1gbps' is not understood"),
        ("  rate: 0mbit\n", "use a larger rate"),
        ("  burst: 0kb\n", "must be positive"),
        ("  delay: 20\n", "time 20 is not understood"),
        ("  loss: 100%\n", "must be a percentage"),
    ],
)
def test_bad_values_in_a_user_profile(tmp_path, link, message):
    with pytest.raises(ProfileError, match=message):
        load_profile(write(tmp_path, "inter_cluster:\n" + link))


@pytest.mark.parametrize("delay", ["", "  delay: 0ms\n"])
def test_jitter_without_delay_is_refused(tmp_path, delay):
    with pytest.raises(ProfileError, match="jitter without delay; add a delay"):
        load_profile(write(tmp_path, "inter_cluster:\n  rate: 1gbit\n  jitter: 1ms\n" + delay))


def test_needs_netem_by_link_field():
    assert not LinkSpec(rate_bps=10**9).needs_netem
    assert LinkSpec(delay_ms=1).needs_netem
    assert LinkSpec(loss_pct=0.1).needs_netem
    assert LinkSpec(delay_ms=1, jitter_ms=1).needs_netem
    assert Profile("p", "", intra_cluster=LinkSpec(delay_ms=1)).needs_netem


# --- what this machine can shape --------------------------------------------------------------------------------


def test_ceiling_from_cores(two_cores):
    assert max_shapeable_rate_bps() == pytest.approx(3e9)


def test_ten_gbit_is_refused_on_two_cores(two_cores):
    with pytest.raises(ProfileError) as err:
        check_shapeable(load_profile("10gbps"))
    message = str(err.value)
    assert "'10gbps' asks for 10 Gbit/s on inter_cluster" in message
    assert "~3 Gbit/s with 2 cores" in message
    assert "use a slower profile or set HARNESS_MAX_RATE" in message


@pytest.mark.parametrize("name", ["unshaped", "10mbps", "100mbps", "500mbps", "1gbps", "wan-1gbps-20ms"])
def test_slower_profiles_are_accepted_on_two_cores(two_cores, name):
    check_shapeable(load_profile(name))


def test_intra_cluster_rate_is_checked_too(two_cores):
    with pytest.raises(ProfileError, match="on intra_cluster"):
        check_shapeable(Profile("fast-intra", "", intra_cluster=LinkSpec(rate_bps=10**10)))


def test_max_rate_override_raises_the_ceiling(two_cores, monkeypatch):
    monkeypatch.setenv("HARNESS_MAX_RATE", "20gbit")
    assert max_shapeable_rate_bps() == 2 * 10**10
    check_shapeable(load_profile("10gbps"))


def test_max_rate_override_lowers_the_ceiling(two_cores, monkeypatch):
    monkeypatch.setenv("HARNESS_MAX_RATE", "500mbit")
    check_shapeable(load_profile("500mbps"))
    with pytest.raises(ProfileError, match="1 Gbit/s on inter_cluster"):
        check_shapeable(load_profile("1gbps"))


def test_bad_max_rate_override_names_the_variable(two_cores, monkeypatch):
    monkeypatch.setenv("HARNESS_MAX_RATE", "fast")
    with pytest.raises(ProfileError, match="HARNESS_MAX_RATE"):
        max_shapeable_rate_bps()
