"""The host-load record beside every run's times (harness/run/host_cpu.py): the arithmetic on kernel counters written
out by hand, and on the real counters a process that is not the run's counts as other work while the run's own
children do not."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.run import host_cpu
from harness.run.host_cpu import HostCpuMeter

TICKS = os.sysconf("SC_CLK_TCK")


def _stat(path, user, system, idle, steal, cpus=4) -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice, in ticks
    line = f"cpu  {user} 0 {system} {idle} 0 0 0 {steal} 7 0"
    path.write_text("\n".join([line, *(f"cpu{i} 0 0 0 0 0 0 0 0 0 0" for i in range(cpus)), "intr 1"]) + "\n")


def test_other_work_is_the_hosts_busy_time_less_the_runs_own_over_cpus_times_wall(tmp_path, monkeypatch):
    clock, own, harness = iter([100.0, 110.0]), iter([3.0, 18.0]), iter([1.0, 2.5])
    monkeypatch.setattr(host_cpu.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(host_cpu, "_own_cpu_s", lambda: next(own))
    monkeypatch.setattr(host_cpu, "_cpu_s", lambda who: next(harness))
    stat = tmp_path / "stat"
    _stat(stat, user=10 * TICKS, system=2 * TICKS, idle=0, steal=0)
    meter = HostCpuMeter(stat)
    # 10 s on 4 CPUs = 40 CPU-seconds: busy 15 + 10 = 25 more, the run 15 of them, so 10 other; 2 s stolen.
    _stat(stat, user=25 * TICKS, system=12 * TICKS, idle=13 * TICKS, steal=2 * TICKS)
    assert meter.read() == {
        "host_cpus": 4,
        "run_cpu_s": pytest.approx(15.0),
        "harness_cpu_s": pytest.approx(1.5),
        "host_other_cpu_share": pytest.approx(10 / 40),
        "host_steal_share": pytest.approx(2 / 40),
    }


def test_guest_time_is_not_counted_twice_and_an_unreadable_file_records_nothing(tmp_path, monkeypatch):
    clock, own = iter([0.0, 1.0]), iter([0.0, 0.0])
    monkeypatch.setattr(host_cpu.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(host_cpu, "_own_cpu_s", lambda: next(own))
    monkeypatch.setattr(host_cpu, "_cpu_s", lambda who: 0.0)
    stat = tmp_path / "stat"
    _stat(stat, user=0, system=0, idle=0, steal=0, cpus=2)
    meter = HostCpuMeter(stat)
    _stat(stat, user=TICKS, system=0, idle=TICKS, steal=0, cpus=2)  # the 7 guest ticks are inside user's
    assert meter.read()["host_other_cpu_share"] == pytest.approx(0.5)
    assert HostCpuMeter(tmp_path / "missing").read() == {}


def _spin(seconds: float, clock: str) -> list[str]:
    """A process that burns CPU until `clock` (time: wall, process_time: its own CPU) has run `seconds`."""
    return [sys.executable, "-c", f"import time\nend = time.{clock}() + {seconds}\nwhile time.{clock}() < end: pass"]


def _cpu_s_of(pid: int) -> float:
    """utime + stime of a live process, from /proc/PID/stat (fields 14 and 15)."""
    fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def test_on_the_real_counters_a_stranger_is_other_work_and_a_reaped_child_is_the_runs():
    cpus = os.cpu_count() or 1
    stranger = subprocess.Popen(_spin(30.0, "time"))
    try:
        stranger_before = _cpu_s_of(stranger.pid)
        started = time.monotonic()
        meter = HostCpuMeter()
        subprocess.run(_spin(1.0, "process_time"), check=True)  # the run's own child, reaped: its CPU is the run's
        stranger_cpu_s = _cpu_s_of(stranger.pid) - stranger_before
        record = meter.read()
        window_s = time.monotonic() - started
    finally:
        stranger.kill()
        stranger.wait()
    assert record["run_cpu_s"] >= 1.0
    # What the stranger burnt in the window (read from its own counters) is other work, whatever else the host ran.
    assert record["host_other_cpu_share"] * cpus * window_s >= 0.8 * stranger_cpu_s > 0
