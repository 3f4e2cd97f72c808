"""tcconfig interop: a profile's link as tcconfig's settings file (checked against tcconfig's own parser and tcset's
printed tc commands where tcconfig is installed), such a file back as a profile, and each refusal."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.net.link import LinkSpec, Profile, ProfileError
from harness.net.profiles import known_profiles, load_profile
from harness.net.tcconfig import (
    export_tcconfig,
    format_tcconfig_rate,
    format_tcconfig_time,
    load_tcconfig,
    write_tcconfig,
)

REPO = Path(__file__).resolve().parents[3]


def exportable(name: str) -> Profile:
    """A shipped profile as it can be exported: a jittered link must allow reordering (netem reorders)."""
    profile = load_profile(name)
    if profile.inter_cluster.jitter_ms:
        profile = dataclasses.replace(profile, inter_cluster=dataclasses.replace(profile.inter_cluster, reorder=True))
    return profile


def write_json(tmp_path: Path, data: object, name: str = "site.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


# --- export -----------------------------------------------------------------------------------------------------


def test_export_is_tcconfigs_format_with_full_one_way_values():
    profile = load_profile("wan-1gbps-40ms-rtt-loss1pct")
    assert export_tcconfig(profile) == {
        "eth0": {"outgoing": {"protocol=ip": {"rate": "1Gbps", "delay": "20.0ms", "loss": "1%"}}, "incoming": {}}
    }
    # Each host shapes its own egress once: the full one-way delay, not the emulation's per-hop half.
    assert profile.inter_cluster.hop_delay_ms == 10.0


def test_export_device_and_jitter():
    profile = exportable("wan-1gbps-20ms")
    assert export_tcconfig(profile, device="ens5") == {
        "ens5": {
            "outgoing": {"protocol=ip": {"rate": "1Gbps", "delay": "20.0ms", "delay-distro": "1.0ms"}},
            "incoming": {},
        }
    }


def test_export_refuses_jitter_that_netem_would_reorder():
    with pytest.raises(ProfileError) as err:
        export_tcconfig(load_profile("consumer-internet-100mbit"))
    message = str(err.value)
    assert "'consumer-internet-100mbit' has jitter without reorder: true" in message
    assert "netem (which tcconfig drives) reorders jittered packets" in message
    allowed = export_tcconfig(load_profile("consumer-internet-100mbit"), allow_reorder=True)
    assert allowed["eth0"]["outgoing"]["protocol=ip"] == {
        "rate": "100Mbps",
        "delay": "15.0ms",
        "delay-distro": "2.5ms",
        "loss": "1%",
    }


def test_export_of_unshaped_and_custom_burst():
    assert export_tcconfig(load_profile("unshaped")) == {"eth0": {"outgoing": {}, "incoming": {}}}
    custom = Profile("c", "", inter_cluster=LinkSpec(rate_bps=10**8, burst_bytes=128 * 1024))
    assert export_tcconfig(custom)["eth0"]["outgoing"]["protocol=ip"] == {"rate": "100Mbps", "burst": 131072}


@pytest.mark.parametrize(
    ("bps", "text"), [(10**9, "1Gbps"), (15 * 10**8, "1500Mbps"), (250_000, "250Kbps"), (8_001, "8001bps")]
)
def test_format_rate(bps, text):
    assert format_tcconfig_rate(bps) == text


@pytest.mark.parametrize(("ms", "text"), [(20.0, "20.0ms"), (0.5, "0.5ms"), (2.25, "2.25ms"), (0.0125, "0.013ms")])
def test_format_time(ms, text):
    assert format_tcconfig_time(ms) == text


def test_write_tcconfig_to_a_file_and_stdout(tmp_path, capsys):
    path = tmp_path / "out.json"
    written = write_tcconfig(load_profile("wan-1gbps-40ms-rtt"), path, device="eth1")
    assert json.loads(path.read_text()) == written == export_tcconfig(load_profile("wan-1gbps-40ms-rtt"), "eth1")
    write_tcconfig(load_profile("wan-1gbps-40ms-rtt"))
    assert json.loads(capsys.readouterr().out) == export_tcconfig(load_profile("wan-1gbps-40ms-rtt"))
    buffer = io.StringIO()
    write_tcconfig(load_profile("1gbps"), buffer)
    assert json.loads(buffer.getvalue())["eth0"]["outgoing"]["protocol=ip"] == {"rate": "1Gbps"}


# --- load and the round trip ------------------------------------------------------------------------------------


# Sites, loss models and traces are refused by the export (test_lossmodel.py and test_trace.py have the latter two).
@pytest.mark.parametrize(
    "name",
    [
        n
        for n in known_profiles()
        if not load_profile(n).sites and not load_profile(n).has_loss_model and load_profile(n).trace is None
    ],
)
def test_export_then_load_is_the_same_link(tmp_path, name):
    profile = exportable(name)
    path = write_json(tmp_path, export_tcconfig(profile), f"{name}.json")
    loaded = load_tcconfig(path)
    assert loaded.inter_cluster == profile.inter_cluster
    assert loaded.intra_cluster == LinkSpec()
    assert loaded.name == name and loaded.source == str(path)


def test_load_profile_takes_a_json_path(tmp_path):
    path = write_json(tmp_path, export_tcconfig(load_profile("cross-continent-100mbit")), "site-a.json")
    profile = load_profile(str(path))
    assert profile.name == "site-a"
    assert profile.inter_cluster == LinkSpec(rate_bps=10**8, delay_ms=35.0)
    assert "site-a.json" in profile.description


def test_load_what_tcshow_prints(tmp_path):
    """tcshow adds the filter handle and netem's default packet limit, and writes rates in its own units."""
    shown = {
        "eth0": {
            "outgoing": {
                "protocol=ip": {
                    "filter_id": "800::800",
                    "delay": "10.0ms",
                    "delay-distro": "2.0ms",
                    "loss": "0.01%",
                    "rate": "250Kbps",
                    "limit": "1000",
                }
            },
            "incoming": {},
        }
    }
    link = load_tcconfig(write_json(tmp_path, shown)).inter_cluster
    # netem reorders jittered packets, so the file describes a reordering link.
    assert link == LinkSpec(rate_bps=250_000, delay_ms=10.0, jitter_ms=2.0, loss_pct=0.01, reorder=True)


@pytest.mark.parametrize(
    ("settings", "expect"),
    [
        ({"rate": "1Gbps"}, LinkSpec(rate_bps=10**9)),
        ({"rate": "1gbps"}, LinkSpec(rate_bps=10**9)),
        ({"rate": "100 Mbit/s"}, LinkSpec(rate_bps=10**8)),
        ({"rate": "8Kibps", "delay": 20}, LinkSpec(rate_bps=8192, delay_ms=20.0)),
        ({"delay": "500us"}, LinkSpec(delay_ms=0.5)),
        ({"delay": "0.1s", "loss": 2}, LinkSpec(delay_ms=100.0, loss_pct=2.0)),
        ({"delay": "5ms", "corrupt": "0%", "duplicate": "0", "reordering": "0%"}, LinkSpec(delay_ms=5.0)),
        ({}, LinkSpec()),
    ],
)
def test_load_units(tmp_path, settings, expect):
    data = {"eth0": {"outgoing": {"protocol=ip": settings}, "incoming": {}}}
    assert load_tcconfig(write_json(tmp_path, data)).inter_cluster == expect


def test_an_empty_outgoing_is_unshaped(tmp_path):
    assert load_tcconfig(write_json(tmp_path, {"eth0": {"outgoing": {}}})).inter_cluster == LinkSpec()


def out(settings: dict, rule: str = "protocol=ip") -> dict:
    return {"eth0": {"outgoing": {rule: settings}, "incoming": {}}}


@pytest.mark.parametrize(
    ("data", "expect"),
    [
        ("{not json", ["is not valid JSON at line 1; fix the syntax"]),
        ([1, 2], ["must be a JSON object of one device"]),
        ({}, ["must be a JSON object of one device"]),
        ({"eth0": {}, "eth1": {}}, ["sets 2 devices (eth0, eth1); keep one"]),
        ({"eth0": "fast"}, ["device eth0 must map to"]),
        ({"eth0": {"outgoing": {}, "sideways": {}}}, ["unknown keys ['sideways']"]),
        (
            {"eth0": {"outgoing": {}, "incoming": {"protocol=ip": {"rate": "1Gbps"}}}},
            ["shapes incoming traffic", "remove the incoming settings"],
        ),
        (
            {"eth0": {"outgoing": {"protocol=ip": {"rate": "1Gbps"}, "dst-port=80, protocol=ip": {"delay": "1ms"}}}},
            ["has 2 outgoing filters", 'keep one "protocol=ip" filter'],
        ),
        (
            out({"delay": "10ms"}, "dst-network=192.168.0.10/32, dst-port=8080, protocol=ip"),
            [
                "shapes only traffic matching 'dst-network=192.168.0.10/32, dst-port=8080, protocol=ip'",
                "remove the network and port filters",
            ],
        ),  # fmt: skip
        (out({"delay": "10ms"}, "protocol=ipv6"), ["shapes only traffic matching 'protocol=ipv6'"]),
        (out({"delay": "10ms", "corrupt": "0.1%"}), ["sets corrupt (packet corruption)", "remove it"]),
        (out({"delay": "10ms", "duplicate": "1%"}), ["sets duplicate (packet duplication)", "remove it"]),
        (out({"delay": "10ms", "reorder": "25%"}), ["sets reorder (a reordering percentage)", "remove it"]),
        (out({"delay": "10ms", "reordering": "25%"}), ["sets reordering (a reordering percentage)"]),
        (out({"delay": "10ms", "delay-distribution": "pareto"}), ["sets delay-distribution", "remove it"]),
        (out({"delay": "10ms", "limit": "50"}), ["netem's packet limit to 50", "remove 'limit'"]),
        (out({"delay": "10ms", "mtu": 9000}), ["unknown setting 'mtu'; remove it"]),
        (out({"rate": "1gbit"}), ["rate '1gbit' is not in a unit tcconfig writes; use e.g. 1Gbps"]),
        (out({"rate": "4bps"}), ["use a larger rate"]),
        (out({"delay": "20 minutes"}), ["delay '20 minutes' is not in a unit"]),
        (out({"delay": "-5ms"}), ["delay and jitter must not be negative"]),
        (out({"delay": "5s"}), ["above 2000 ms one-way"]),
        (out({"delay-distro": "1ms"}), ["sets jitter without delay"]),
        (out({"loss": "100%"}), ["must be a percentage in [0, 100)"]),
        (out({"loss": "lots"}), ["loss 'lots' is not understood"]),
        (out({"rate": "1Gbps", "burst": 1000}), ["below one full-size packet"]),
        (out({"rate": "1Gbps", "burst": "64kb"}), ["burst '64kb' must be a whole number of bytes"]),
        (out("fast"), ["must map setting names"]),
    ],
)
def test_load_refusals(tmp_path, data, expect):
    path = write_json(tmp_path, data)
    with pytest.raises(ProfileError) as err:
        load_tcconfig(path)
    message = str(err.value)
    assert message.startswith(f"tcconfig file {path}")
    assert "\n" not in message
    for fragment in expect:
        assert fragment in message, message


def test_missing_file_and_folder(tmp_path):
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(str(tmp_path / "nope.json"))
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(ProfileError, match="is a folder"):
        load_tcconfig(tmp_path / "dir.json")


def test_cli_help_imports_neither_tcconfig_module():
    code = "import sys, harness.cli; print(sorted(m for m in sys.modules if 'tcconfig' in m))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --- tcconfig's own parser --------------------------------------------------------------------------------------

ROUND_TRIP = ["wan-1gbps-40ms-rtt-loss1pct", "wan-1gbps-20ms", "same-region-1gbit", "consumer-internet-100mbit"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # tcconfig 0.30's pyparsing calls
@pytest.mark.parametrize("name", ROUND_TRIP)
def test_tcconfigs_importer_takes_every_exported_setting(tmp_path, name):
    """tcconfig's --import-setting path validates the file and turns each setting into a tcset option; an option
    tcset does not know is dropped silently, so every exported key must come back as an option."""
    pytest.importorskip("tcconfig", reason="tcconfig is not installed (pip install -e '.[tcconfig]')")
    from tcconfig._importer import TcConfigLoader
    from tcconfig._logger import logger

    settings = export_tcconfig(exportable(name))
    loader = TcConfigLoader(logger)
    loader.load_tcconfig(str(write_json(tmp_path, settings)))
    commands = loader.get_tcconfig_commands()
    assert len(commands) == 1
    options = commands[0].split()
    assert options[:3] == ["tcset", "eth0", "--direction=outgoing"]
    expected = [f"--{key}={value}" for key, value in settings["eth0"]["outgoing"]["protocol=ip"].items()]
    assert options[3:] == expected


def _tcset_commands(path: Path) -> str:
    """What `tcset FILE --import-setting --tc-command` prints: the tc commands, applied to nothing."""
    pytest.importorskip("tcconfig", reason="tcconfig is not installed (pip install -e '.[tcconfig]')")
    bindir = str(Path(sys.executable).parent)
    tcset = shutil.which("tcset", path=bindir)
    if tcset is None or shutil.which("tc") is None:
        pytest.skip("needs the tcset script next to this Python and iproute2's tc")
    # --import-setting runs `tcset DEVICE ...` per filter, found on PATH.
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = subprocess.run(
        [tcset, str(path), "--import-setting", "--tc-command"], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.parametrize("name", ["wan-1gbps-40ms-rtt-loss1pct", "consumer-internet-100mbit"])
def test_tcset_prints_the_profiles_link(tmp_path, name):
    profile = exportable(name)
    link = profile.inter_cluster
    printed = _tcset_commands(write_json(tmp_path, export_tcconfig(profile), f"{name}.json"))
    netem = [line for line in printed.splitlines() if " netem " in line]
    assert len(netem) == 1, printed
    delay = re.search(r" delay ([0-9.]+)ms(?: ([0-9.]+)ms)?", netem[0])
    loss = re.search(r" loss ([0-9.]+)%", netem[0])
    assert delay and float(delay.group(1)) == link.delay_ms, netem[0]  # the full one-way delay
    assert float(delay.group(2) or 0) == link.jitter_ms, netem[0]
    assert loss and float(loss.group(1)) == pytest.approx(link.loss_pct), netem[0]
    rates = re.findall(r" htb rate ([0-9.]+)[kK]bit ceil", printed)
    assert [float(r) * 1000 for r in rates] == [link.rate_bps], printed


def test_export_refuses_a_profile_with_per_site_links():
    """tcconfig's file is one device's settings, the same on every host: a straggler's own link cannot be in it, and
    exporting the rest alone made the straggler profile a plain 1 Gbit/s link."""
    profile = load_profile("straggler-1gbps-one-site-100mbps")
    assert profile.sites
    with pytest.raises(ProfileError, match=re.escape("gives site 3 its own link")):
        export_tcconfig(profile)
    with pytest.raises(ProfileError, match="one device per host"):
        write_tcconfig(profile, io.StringIO())
