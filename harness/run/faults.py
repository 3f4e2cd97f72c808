"""Faults on purpose: `--fault KIND:STEP:ARG`, injected by the runner when rank 0 has completed STEP steps.

    link-down:STEP:SECONDS   every cluster's link loses all traffic for SECONDS (the bridge-side veth ends are set
                             down through netlink, then up again): TCP retransmits, collectives wait or time out
    rate:STEP:RATE           the inter-cluster link's rate becomes RATE (tc units, e.g. 100mbit) from then on (tbf
                             changed in place on both ends of every cluster's veth)
    kill:STEP:RANK           rank RANK gets SIGKILL (a crashed host): the run fails, naming that rank

Each fault is logged as `fault` events in events/faults.jsonl (when it was injected and, for link-down, restored)
and listed in summary.json's `faults`: {fault, step, seconds | rate_bps | rank, injected_at_step, injected_t, and
restored_t for an outage}. Link faults need the netns backend.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness.backends import capabilities
from harness.errors import UserError
from harness.net.link import LinkSpec, ProfileError, parse_rate_bps
from harness.net.profiles import max_shapeable_rate_bps
from harness.units import format_rate

FAULT_KINDS = ("link-down", "rate", "kill")
# An outage longer than this is not a fault to ride out but a dead link; the collective timeout would end the run.
MAX_OUTAGE_S = 3600.0


class FaultError(UserError):
    """A --fault that cannot be injected; the message names the fix."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int  # injected once rank 0 has completed this many steps
    seconds: float | None = None  # link-down
    rate_bps: int | None = None  # rate
    rank: int | None = None  # kill

    def describe(self) -> str:
        what = {
            "link-down": f"link down for {self.seconds:g} s",
            "rate": f"link rate -> {self.rate_bps} bit/s",
            "kill": f"SIGKILL rank {self.rank}",
        }[self.kind]
        return f"{what} at step {self.step}"


def parse_fault(text: str) -> Fault:
    """`KIND:STEP:ARG` -> Fault, or FaultError naming what is wrong."""
    parts = text.split(":")
    if len(parts) != 3:
        raise FaultError(
            f"--fault {text!r} must be KIND:STEP:ARG, e.g. link-down:50:10 (kinds: {', '.join(FAULT_KINDS)})"
        )
    kind, step_text, arg = parts
    if kind not in FAULT_KINDS:
        raise FaultError(f"--fault {text!r}: unknown fault kind {kind!r}; use one of {', '.join(FAULT_KINDS)}")
    try:
        step = int(step_text)
    except ValueError:
        raise FaultError(f"--fault {text!r}: the step {step_text!r} must be a whole number of training steps") from None
    if kind == "link-down":
        try:
            seconds = float(arg)
        except ValueError:
            raise FaultError(f"--fault {text!r}: the outage {arg!r} must be a number of seconds") from None
        if not 0 < seconds <= MAX_OUTAGE_S:
            raise FaultError(f"--fault {text!r}: the outage must be between 0 and {MAX_OUTAGE_S:g} seconds")
        return Fault(kind, step, seconds=seconds)
    if kind == "rate":
        try:
            return Fault(kind, step, rate_bps=parse_rate_bps(arg))
        except ProfileError as err:
            raise FaultError(f"--fault {text!r}: {err}") from None
    try:
        return Fault(kind, step, rank=int(arg))
    except ValueError:
        raise FaultError(f"--fault {text!r}: the rank {arg!r} must be a whole number") from None


def check_faults(
    faults: tuple[Fault, ...],
    steps: int,
    world_size: int,
    backend: str,
    link_rate_bps: int | None,
    link: LinkSpec | None = None,
) -> None:
    """Each fault happens inside the run, on something that exists; raises FaultError. `link`: the inter-cluster
    link a rate fault re-rates (its queue bound stays), else a default one at `link_rate_bps`."""
    for fault in faults:
        if fault.kind == "rate" and link_rate_bps is None:
            raise FaultError(
                "--fault rate changes the shaped link's rate, and this profile's inter-cluster link has none; use a "
                "profile with a rate"
            )
        if fault.kind == "rate":
            _check_rate(fault, link or LinkSpec(rate_bps=link_rate_bps))
        if not 0 < fault.step < steps:
            raise FaultError(
                f"--fault {fault.kind} at step {fault.step} is outside the run; use a step between 1 and {steps - 1} "
                f"(--steps {steps})"
            )
        if fault.kind == "kill" and not 0 <= fault.rank < world_size:
            raise FaultError(
                f"--fault kill names rank {fault.rank}, but the run has ranks 0 to {world_size - 1}; name one of them"
            )
        if fault.kind != "kill" and not capabilities(backend).link_faults:
            raise FaultError(
                f"--fault {fault.kind} needs the netns backend (whose links can fail on purpose); use --backend netns"
            )


def _check_rate(fault: Fault, link: LinkSpec) -> None:
    """The new rate is held to what a profile's is: the machine's ceiling, and tbf's fields with the link's queue
    bound (the backend re-derives the burst for it, harness/backends/netns.py set_link_rate)."""
    ceiling = max_shapeable_rate_bps()
    if fault.rate_bps > ceiling:
        raise FaultError(
            f"--fault rate asks for {format_rate(fault.rate_bps)}, more than this machine can shape faithfully "
            f"(~{format_rate(ceiling)} with {os.cpu_count()} cores); use a slower rate or set HARNESS_MAX_RATE if you "
            "have measured that your machine keeps up"
        )
    try:
        dataclasses.replace(link, rate_bps=fault.rate_bps, burst_bytes=None)
    except ProfileError as err:
        raise FaultError(f"--fault rate at step {fault.step}: {err}") from None


class FaultInjector:
    """Injects the run's faults as rank 0 reaches their steps and restores outages when they are over.

    `cluster` is the backend (set_link_up, set_link_rate), `kill` a function of the rank.
    """

    def __init__(self, faults: tuple[Fault, ...], cluster: Any, kill: Any, log_path: Path):
        self.pending = sorted(faults, key=lambda f: f.step)
        self.cluster, self.kill, self.log_path = cluster, kill, log_path
        self.restore_at: float | None = None
        self.records: list[dict[str, Any]] = []

    def _log(self, record: dict[str, Any]) -> None:
        with self.log_path.open("a") as log:
            log.write(json.dumps({"t": time.time(), "kind": "fault", **record}) + "\n")

    def poll(self, steps_done: int) -> None:
        """Call often: inject what is due at `steps_done` (rank 0's completed steps), restore an outage that is over."""
        now = time.monotonic()
        if self.restore_at is not None and now >= self.restore_at:
            self.restore()
        while self.pending and steps_done >= self.pending[0].step:
            fault = self.pending.pop(0)
            record = {
                "fault": fault.kind,
                **{k: v for k, v in asdict(fault).items() if k != "kind" and v is not None},
                "injected_at_step": steps_done,
                "injected_t": time.time(),
            }
            if fault.kind == "link-down":
                self.cluster.set_link_up(False)
                self.restore_at = now + fault.seconds
            elif fault.kind == "rate":
                self.cluster.set_link_rate(fault.rate_bps)
            else:
                self.kill(fault.rank)
            self.records.append(record)
            self._log({"event": "injected", **record})

    def outage_note(self, timeout_s: float) -> str | None:
        """The outage a failure now may be due to, in words: one in progress, or one that ended less than
        `timeout_s` (the collective timeout: a collective that waited through it may still give up) ago."""
        outages = [r for r in self.records if r["fault"] == "link-down"]
        if not outages:
            return None
        last = outages[-1]
        what = f"the injected link-down of {last['seconds']:g} s at step {last['injected_at_step']}"
        timeout = f"with a collective timeout of {timeout_s:g} s"
        if self.restore_at is not None:
            return f"during {what}, {timeout}"
        ago = time.time() - last["restored_t"]
        return f"{ago:.0f} s after {what} ended, {timeout}" if ago < timeout_s else None

    def restore(self) -> None:
        """End an outage in progress (also at teardown, so a run never ends with its link down)."""
        if self.restore_at is None:
            return
        self.cluster.set_link_up(True)
        self.restore_at = None
        outage = next(r for r in reversed(self.records) if r["fault"] == "link-down")
        outage["restored_t"] = time.time()
        self._log({"event": "restored", "fault": "link-down", "restored_t": outage["restored_t"]})
