"""A profile's `trace: FILE` (harness/net/trace.py): the CSV format, every refusal (one sentence naming the fix,
before anything is created), the profile it makes, its round trip through config.json, and the shipped traces."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.net.link import Profile, ProfileError
from harness.net.profiles import PROFILE_DIR, check_shapeable, load_profile
from harness.net.tcconfig import export_tcconfig
from harness.net.trace import (
    MAX_ROWS,
    delay_ms_at,
    hop_delay_schedule,
    load_trace,
    max_rate_bps,
    mean_rate_bps,
    parse_trace,
    rate_bps_at,
    replays_delay,
    replays_rate,
)
from harness.net.tracepoints import LinkTrace, TracePoint
from harness.run.config import RunConfig

SHIPPED_TRACES = sorted(p.stem for p in PROFILE_DIR.glob("trace-*.yaml"))


def profile_with(tmp_path: Path, csv: str, yaml: str = "inter_cluster: {}\n") -> str:
    (tmp_path / "traces").mkdir(exist_ok=True)
    (tmp_path / "traces" / "t.csv").write_text(csv)
    path = tmp_path / "mine.yaml"
    path.write_text(f"description: a test trace\ntrace: traces/t.csv\n{yaml}")
    return str(path)


# --- the format ---------------------------------------------------------------------------------------------------


def test_rows_hold_their_rate_and_delay_from_their_time():
    trace = parse_trace("# a comment\nseconds,rate,delay\n\n0,50mbit,20ms\n2.5,12000000,45ms\n", "t.csv")
    assert trace.points == (TracePoint(0.0, 50_000_000, 20.0), TracePoint(2.5, 12_000_000, 45.0))
    assert replays_rate(trace) and replays_delay(trace)
    assert [rate_bps_at(trace, t, None) for t in (-1, 0, 2.4, 2.5, 100)] == [50e6, 50e6, 50e6, 12e6, 12e6]
    assert [delay_ms_at(trace, t) for t in (0, 2.5, 1e6)] == [20.0, 45.0, 45.0]  # the last row holds
    assert max_rate_bps(trace) == 50_000_000


def test_either_column_may_be_absent_and_columns_come_in_any_order():
    rate_only = parse_trace("rate,seconds\n10mbit,0\n20mbit,1\n", "t.csv")
    assert rate_only.points == (TracePoint(0.0, 10_000_000), TracePoint(1.0, 20_000_000))
    assert not replays_delay(rate_only) and delay_ms_at(rate_only, 0.5) is None
    delay_only = parse_trace("seconds,delay\n0,5ms\n1,10ms\n", "t.csv")
    assert not replays_rate(delay_only) and rate_bps_at(delay_only, 0.5, 7) == 7
    assert mean_rate_bps(delay_only, 0, 1, 7) == 7


def test_the_mean_rate_weights_each_row_by_its_time_in_the_interval():
    trace = parse_trace("seconds,rate\n0,10mbit\n1,30mbit\n2,20mbit\n", "t.csv")
    assert mean_rate_bps(trace, 0.5, 1.5, None) == pytest.approx(20e6)
    assert mean_rate_bps(trace, 0.0, 3.0, None) == pytest.approx(20e6)
    assert mean_rate_bps(trace, 1.2, 1.7, None) == pytest.approx(30e6)


def test_the_delay_line_gets_one_hop_a_row_where_the_delay_changes():
    trace = parse_trace("seconds,rate,delay\n0,10mbit,20ms\n1,20mbit,20ms\n2.5,10mbit,45ms\n", "t.csv")
    assert hop_delay_schedule(trace) == "0.0:10.0,2.5:22.5"


# --- refusals -----------------------------------------------------------------------------------------------------

REFUSED = {
    "empty": ("# nothing\n", "is empty; write a header"),
    "header only": ("seconds,rate\n", "has a header but no rows"),
    "no seconds": ("rate,delay\n10mbit,5ms\n", "must name seconds and rate and/or delay"),
    "seconds alone": ("seconds\n0\n", "must name seconds and rate and/or delay"),
    "unknown column": ("seconds,rate,loss\n0,1mbit,1%\n", "unknown: loss"),
    "repeated column": ("seconds,rate,rate\n0,1mbit,2mbit\n", "each once"),
    "zero rate": ("seconds,rate\n0,0mbit\n", "line 2: rate '0mbit' must be positive"),
    "zero plain rate": ("seconds,rate\n0,0\n", "line 2: rate '0' must be positive"),
    "negative rate": ("seconds,rate\n0,10mbit\n1,-5mbit\n", "line 3: rate '-5mbit' must be positive"),
    "rate past tbf": ("seconds,rate\n0,40gbit\n", "line 2: rate 40gbit is more than tbf's 32-bit rate field"),
    "negative delay": ("seconds,delay\n0,10ms\n1,-3ms\n", "line 3: delay '-3ms' must not be negative"),
    "delay without unit": ("seconds,delay\n0,10\n", "line 2: delay '10' is not understood"),
    "unsorted": ("seconds,rate\n0,1mbit\n5,2mbit\n3,1mbit\n", "line 4: 3 s does not come after the row before"),
    "repeated time": ("seconds,rate\n0,1mbit\n2,2mbit\n2,1mbit\n", "line 4: 2 s does not come after"),
    "rows too close": ("seconds,rate\n0,1mbit\n0.05,2mbit\n", "rows must be at least 0.1 s apart"),
    "not from 0": ("seconds,rate\n1,1mbit\n", "line 2: the first row is at 1 s; start at 0"),
    "missing value": ("seconds,rate,delay\n0,1mbit\n", "line 2: '0,1mbit' is not understood; write 3 values"),
    "empty value": ("seconds,rate,delay\n0,,5ms\n", "line 2: '0,,5ms' is not understood"),
    "bad seconds": ("seconds,rate\nsoon,1mbit\n", "line 2: seconds 'soon' must be a number of seconds"),
    "infinite seconds": ("seconds,rate\n0,1mbit\ninf,2mbit\n", "line 3: seconds 'inf' must be a number"),
    "negative seconds": ("seconds,rate\n-1,1mbit\n", "line 2: seconds '-1' must be a number of seconds from 0"),
    "bad rate": ("seconds,rate\n0,fast\n", "line 2: rate 'fast' is not understood"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_bad_trace_is_refused_naming_the_line_and_the_fix(case, tmp_path):
    csv, expected = REFUSED[case]
    with pytest.raises(ProfileError, match=None) as refused:
        load_profile(profile_with(tmp_path, csv))
    message = str(refused.value)
    assert expected in message, message
    assert "t.csv" in message
    assert "\n" not in message


def test_too_many_rows_are_refused(tmp_path):
    csv = "seconds,rate\n" + "".join(f"{i},{1 + i % 2}mbit\n" for i in range(MAX_ROWS + 1))
    with pytest.raises(ProfileError, match=f"more than {MAX_ROWS:,}; use fewer, longer rows"):
        load_profile(profile_with(tmp_path, csv))


def test_a_missing_trace_file_names_the_path_to_write(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("description: x\ntrace: traces/absent.csv\n")
    with pytest.raises(ProfileError, match=r"mine.yaml: trace: trace file .*absent.csv does not exist; write its path"):
        load_profile(str(path))


def test_a_folder_binary_file_or_non_string_key_is_refused(tmp_path):
    (tmp_path / "dir.csv").mkdir()
    with pytest.raises(ProfileError, match="is a folder; name a CSV file"):
        load_trace(tmp_path / "dir.csv", "mine.yaml: trace")
    (tmp_path / "bin.csv").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ProfileError, match="is not UTF-8 text"):
        load_trace(tmp_path / "bin.csv", "mine.yaml: trace")
    path = tmp_path / "mine.yaml"
    path.write_text("description: x\ntrace: [a, b]\n")
    with pytest.raises(ProfileError, match="trace must name a CSV file"):
        load_profile(str(path))


def test_a_profile_may_not_set_what_its_trace_sets(tmp_path):
    with pytest.raises(ProfileError, match="sets inter_cluster rate and its trace has a rate column; remove one"):
        load_profile(profile_with(tmp_path, "seconds,rate\n0,1mbit\n", "inter_cluster: {rate: 10mbit}\n"))
    with pytest.raises(ProfileError, match="sets inter_cluster delay and its trace has a delay column"):
        load_profile(profile_with(tmp_path, "seconds,delay\n0,1ms\n", "inter_cluster: {delay: 10ms}\n"))


def test_a_trace_with_sites_is_refused(tmp_path):
    with pytest.raises(ProfileError, match="has a trace and sites; a trace replays every site's link alike"):
        load_profile(profile_with(tmp_path, "seconds,rate\n0,1mbit\n", "sites: {1: {rate: 5mbit}}\n"))


def test_every_row_is_checked_as_the_link_it_makes(tmp_path):
    # The jitter on inter_cluster must fit under every row's delay (no reordering), not only the first.
    with pytest.raises(ProfileError, match=r"row 2 \(at 1 s\): jitter 4 ms is larger than the delay 3 ms"):
        load_profile(profile_with(tmp_path, "seconds,delay\n0,10ms\n1,3ms\n", "inter_cluster: {jitter: 4ms}\n"))
    with pytest.raises(ProfileError, match=r"row 2 \(at 1 s\): delay 5000 ms is above 2000 ms"):
        load_profile(profile_with(tmp_path, "seconds,delay\n0,10ms\n1,5s\n"))


def test_the_fastest_row_is_held_to_the_machine_s_ceiling(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("HARNESS_MAX_RATE", raising=False)
    profile = load_profile(profile_with(tmp_path, "seconds,rate\n0,100mbit\n1,5gbit\n"))
    with pytest.raises(ProfileError, match="asks for 5 Gbit/s on its trace's fastest row"):
        check_shapeable(profile)


# --- the profile --------------------------------------------------------------------------------------------------


def test_the_first_row_is_the_link_at_the_start_and_the_rest_keep_the_profile_s_keys(tmp_path):
    profile = load_profile(
        profile_with(tmp_path, "seconds,rate,delay\n0,40mbit,15ms\n2,5mbit,60ms\n", "inter_cluster: {queue: 1mb}\n")
    )
    link = profile.inter_cluster
    assert (link.rate_bps, link.delay_ms, link.queue_bytes) == (40_000_000, 15.0, 1024**2)
    assert profile.trace.source == str(tmp_path / "traces" / "t.csv")
    assert profile.needs_netem


def test_an_absolute_trace_path_works_from_anywhere(tmp_path):
    (tmp_path / "abs.csv").write_text("seconds,rate\n0,3mbit\n")
    path = tmp_path / "sub" / "mine.yaml"
    path.parent.mkdir()
    path.write_text(f"description: x\ntrace: {tmp_path / 'abs.csv'}\n")
    assert load_profile(str(path)).inter_cluster.rate_bps == 3_000_000


def test_config_json_holds_the_points_not_only_the_path(tmp_path):
    profile = load_profile(profile_with(tmp_path, "seconds,rate,delay\n0,40mbit,15ms\n2,5mbit,60ms\n"))
    assert Profile.from_dict(profile.to_dict()) == profile
    assert LinkTrace.from_dict(profile.trace.to_dict()) == profile.trace
    config = RunConfig.build("allreduce", profile, steps=3)
    config.save(tmp_path / "config.json")
    (tmp_path / "traces" / "t.csv").unlink()  # the run folder alone says what was replayed
    assert RunConfig.load(tmp_path / "config.json").profile.trace == profile.trace
    assert Profile.from_dict(load_profile("1gbps").to_dict()).trace is None


# --- the shipped traces -------------------------------------------------------------------------------------------


def test_two_or_three_traces_ship_and_say_where_their_figures_come_from():
    assert 2 <= len(SHIPPED_TRACES) <= 3


@pytest.mark.parametrize("name", SHIPPED_TRACES)
def test_a_shipped_trace_is_short_within_5_to_500_mbit_and_cites_its_source(name):
    profile = load_profile(name)
    trace = profile.trace
    rates = [p.rate_bps for p in trace.points]
    assert all(5e6 <= rate <= 500e6 for rate in rates)
    assert 10 <= trace.points[-1].seconds <= 300
    assert replays_rate(trace) and replays_delay(trace)
    assert "illustrative" in profile.description or "measure" in profile.description
    header = Path(trace.source).read_text().split("seconds,")[0]
    assert "illustrative" in header.lower()
    assert "http" not in header and "http" not in Path(profile.source).read_text()


def test_a_trace_cannot_be_exported_to_tcconfig():
    with pytest.raises(ProfileError, match="replays a trace, which a tcconfig file .* cannot hold"):
        export_tcconfig(load_profile(SHIPPED_TRACES[0]))
