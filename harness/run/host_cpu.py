"""How busy the host was with work other than the run, while the run ran: the evidence beside every timing.

A run's step times are only as good as the CPU it had. On a shared machine (CI, a laptop, a study with tests running
beside it) other processes take cores from the ranks and a compute-bound method slows down by whatever they took,
while a link-bound one barely notices: a perturbed run looks like a slower method. So each run records:

- `host_other_cpu_share`: the CPU time the whole host spent busy (the kernel's /proc/stat, all CPUs) minus what the
  run's own processes spent (the harness, and every worker, delay line and tool it started and reaped: getrusage's
  SELF and CHILDREN), over the run's CPU capacity (CPUs x wall time). 0 on an otherwise idle host; 0.25 on two CPUs
  means half a core went elsewhere. A process of the run that is never reaped is counted as "other", so the figure
  errs towards flagging. `run_cpu_s` is the run's own, `harness_cpu_s` the harness process's part of it.
- `host_steal_share`: on a virtual machine, the time the hypervisor gave the CPUs to other guests, same units.

Above HOST_BUSY_SHARE the comparison report names the run (harness/analysis/report/compare.py); the figure is not
used to correct any time.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Other processes' share of the host's CPU above which a run's times are flagged as taken on a busy host.
HOST_BUSY_SHARE = 0.10

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
# /proc/stat's columns after "cpu": user nice system idle iowait irq softirq steal guest guest_nice. guest time is
# already inside user (and guest_nice inside nice), so it is not added again.
_BUSY_COLUMNS = (0, 1, 2, 5, 6)
_STEAL_COLUMN = 7


@dataclass(frozen=True)
class _Sample:
    at_s: float  # time.monotonic()
    host_busy_s: float  # all CPUs together
    host_steal_s: float
    cpus: int
    own_cpu_s: float  # this process and its reaped descendants
    harness_cpu_s: float  # this process alone


def _read_stat(stat: Path) -> tuple[float, float, int]:
    lines = stat.read_text().splitlines()
    columns = [int(v) for v in lines[0].split()[1:]]
    cpus = sum(1 for line in lines[1:] if line.startswith("cpu"))
    busy = sum(columns[i] for i in _BUSY_COLUMNS if i < len(columns))
    steal = columns[_STEAL_COLUMN] if len(columns) > _STEAL_COLUMN else 0
    return busy / _TICKS_PER_S, steal / _TICKS_PER_S, cpus


def _cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _own_cpu_s() -> float:
    return _cpu_s(resource.RUSAGE_SELF) + _cpu_s(resource.RUSAGE_CHILDREN)


class HostCpuMeter:
    """Started before a run builds anything, read after its processes are reaped (module doc).

    Args:
        stat: the kernel's CPU counters; a meter whose file cannot be read records nothing.
    """

    def __init__(self, stat: Path = Path("/proc/stat")):
        self._stat = stat
        self._start = self._sample()

    def _sample(self) -> _Sample | None:
        try:
            busy, steal, cpus = _read_stat(self._stat)
        except (OSError, ValueError, IndexError):
            return None
        return _Sample(time.monotonic(), busy, steal, cpus, _own_cpu_s(), _cpu_s(resource.RUSAGE_SELF))

    def read(self) -> dict[str, Any]:
        """The summary's host fields for the time since the meter started ({} where /proc/stat is unreadable)."""
        end = self._sample()
        if self._start is None or end is None or end.cpus < 1:
            return {}
        capacity_s = end.cpus * (end.at_s - self._start.at_s)
        if capacity_s <= 0:
            return {}
        run_cpu_s = end.own_cpu_s - self._start.own_cpu_s
        other_cpu_s = max(0.0, end.host_busy_s - self._start.host_busy_s - run_cpu_s)
        return {
            "host_cpus": end.cpus,
            "run_cpu_s": run_cpu_s,
            # The harness process's own share of that (building, watching, tearing down; the ranks are children).
            "harness_cpu_s": end.harness_cpu_s - self._start.harness_cpu_s,
            "host_other_cpu_share": min(1.0, other_cpu_s / capacity_s),
            "host_steal_share": min(1.0, (end.host_steal_s - self._start.host_steal_s) / capacity_s),
        }
