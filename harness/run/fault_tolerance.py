"""Failures that heal: `--set fault_tolerance=torchft`, the harness's side (trainers/fault_tolerance.py: the ranks').

Each cluster is a torchft replica group. The harness runs torchft's lighthouse (quorum) as a process of its own in
cluster 0's namespace, so the other clusters' quorum traffic crosses the shaped link as their training does; a
rank killed by `--fault kill:STEP:RANK` is started again after `restart_delay_s`, rejoins the quorum at the others'
next round and heals from a live peer over the link while the others train on (as long as `min_replicas` remain).
A failure nobody injected still fails the run: fault tolerance is for the failures under study, not a way to hide
a bug.

What this covers today: allreduce (FT-DDP), opendiloco, dilocox (its gather or fp16 exchange, overlap streaming or
none), sparseloco and demo, one stage per cluster, the netns backend. A method says itself whether its settings can
be carried (`MethodConfig.fault_tolerance_refusal`): DiLoCoX's reduce and its delayed and eager overlaps,
CocktailSGD (its update lands a step late), local (nothing to agree on) and pipeline stages are refused before the
run (`check_fault_tolerance`).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from harness.errors import UserError
from harness.process import set_parent_death_signal, stop_process
from harness.run.events import EventTail

ENGINES = ("none", "torchft")
# Cluster 0's namespace: the lighthouse's port. Each cluster's replica group listens on its own ports from
# GROUP_PORT_BASE; a restarted replica takes the next block (the dead one's sockets may linger in TIME_WAIT).
LIGHTHOUSE_PORT = 29510
GROUP_PORT_BASE = 29520
PORTS_PER_GROUP = 3
# How long the lighthouse gets to exit before SIGKILL.
STOP_GRACE_S = 3.0


@dataclass(frozen=True)
class FaultTolerance:
    """How a run survives failures; `--set fault_tolerance=ENGINE`, and `--set min_replicas=N` / `restart_delay_s=S`."""

    engine: Literal["none", "torchft"] = field(
        default="none",
        metadata={"help": "none: a failed rank fails the run; torchft: replicas fail, restart and heal."},
    )
    min_replicas: int = field(
        default=1,
        metadata={"help": "The fewest replicas a round may train with; with fewer, the others wait for a quorum."},
    )
    restart_delay_s: float = field(
        default=2.0,
        metadata={"help": "How long a killed replica stays down before the harness starts it again (seconds)."},
    )

    replica_timeout_s: float = field(
        default=60.0,
        metadata={
            "help": "How long a replica's exchange, commit or heal may take before it counts as failed (seconds). "
            "A peer killed mid-exchange does not always close its connection, and then the survivors wait this long "
            "before they discard the round; a heal moves the whole state across the link and must fit in it too."
        },
    )

    mtbf_s: float | None = field(
        default=None,
        metadata={
            "help": "Random failures: each replica is killed after an up time drawn from an exponential distribution "
            "of this mean (seconds), and restarted as a --fault kill is; none: no random failures."
        },
    )
    failure_seed: int = field(
        default=0,
        metadata={
            "help": "The random failures' seed; with the run's --seed it seeds each replica's own stream of draws, so "
            "a study's seeds see different failure times."
        },
    )

    @property
    def enabled(self) -> bool:
        return self.engine != "none"


def lighthouse_url(address: str) -> str:
    return f"http://{address}:{LIGHTHOUSE_PORT}"


def group_ports(incarnation: int) -> tuple[int, int, int]:
    """(replica group's process group, its torchft store, its Manager) for a replica's `incarnation`-th start."""
    base = GROUP_PORT_BASE + PORTS_PER_GROUP * incarnation
    return base, base + 1, base + 2


class FaultToleranceError(UserError):
    """A fault-tolerance setting this run cannot honour; the message names the fix."""


def check_fault_tolerance(
    ft: FaultTolerance,
    method: str,
    method_refusal: str | None,
    clusters: int,
    stages: int,
    backend: str,
    kills_by_step: dict[int, int],
    checkpoint_every: int,
) -> None:
    """Everything fault tolerance needs, checked before the host is touched; `method_refusal`: why the method's
    settings cannot be carried (MethodConfig.fault_tolerance_refusal), None where they can; `kills_by_step`: how many
    ranks the run's kill faults take down at each step."""
    if ft.engine not in ENGINES:
        raise FaultToleranceError(
            f"--set fault_tolerance={ft.engine} names no fault tolerance; use one of {', '.join(ENGINES)}"
        )
    if not ft.enabled:
        for name in ("min_replicas", "restart_delay_s", "replica_timeout_s", "mtbf_s", "failure_seed"):
            if getattr(ft, name) != getattr(FaultTolerance(), name):
                raise FaultToleranceError(
                    f"--set {name} is a setting of fault tolerance, which this run does not use; add "
                    "--set fault_tolerance=torchft or drop it"
                )
        return
    from trainers.fault_tolerance import torchft_missing

    missing = torchft_missing()
    if missing:
        raise FaultToleranceError(missing)
    if method_refusal is not None:
        raise FaultToleranceError(f"fault tolerance cannot carry {method}: {method_refusal}")
    if stages != 1 or backend != "netns" or clusters < 2:
        raise FaultToleranceError(
            "fault tolerance runs one stage per cluster, on the netns backend, with at least 2 clusters (replicas "
            f"to fail over to); this run has {stages} stage(s), {clusters} cluster(s), backend {backend}"
        )
    if not 1 <= ft.min_replicas <= clusters:
        raise FaultToleranceError(
            f"--set min_replicas={ft.min_replicas} must be between 1 and the run's {clusters} clusters"
        )
    if not 0 <= ft.restart_delay_s <= 3600:
        raise FaultToleranceError(f"--set restart_delay_s={ft.restart_delay_s:g} must be between 0 and 3600 seconds")
    if not 0 < ft.replica_timeout_s <= 86400:
        raise FaultToleranceError(
            f"--set replica_timeout_s={ft.replica_timeout_s:g} must be a positive number of seconds (at most a day)"
        )
    if ft.mtbf_s is not None and not (isinstance(ft.mtbf_s, int | float) and 0 < ft.mtbf_s < math.inf):
        raise FaultToleranceError(
            f"--set mtbf_s={ft.mtbf_s} must be a positive number of seconds (the mean up time between failures), or "
            "none for no random failures"
        )
    for step, killed in sorted(kills_by_step.items()):
        if clusters - killed < ft.min_replicas:
            raise FaultToleranceError(
                f"--fault kill at step {step} takes down {killed} of {clusters} replicas, leaving fewer than "
                f"min_replicas={ft.min_replicas} to train on; kill fewer at once or lower min_replicas"
            )
    if checkpoint_every:
        raise FaultToleranceError(
            "fault tolerance heals a failed replica from a live peer and does not write checkpoints yet; drop "
            "--set checkpoint_every"
        )


class Restarts:
    """The runner's side of healing: a rank the run killed on purpose is started again `delay_s` later.

    `start(rank, incarnation)` starts a rank's worker (incarnation 1 for its first restart, and so on). Each
    restart is logged as a `fault` event in events/faults.jsonl and kept in `records` (summary.json's `restarts`):
    {rank, killed_t, restarted_t, incarnation}.
    """

    def __init__(self, delay_s: float, start: Callable[[int, int], Any], log_path: Path):
        self.delay_s, self.start, self.log_path = delay_s, start, log_path
        self.due: dict[int, float] = {}
        self.records: list[dict[str, Any]] = []

    def killed(self, rank: int, cause: str = "fault", postponed_s: float = 0.0) -> None:
        """`rank` was killed just now (`cause`: "fault", a --fault kill, or "mtbf"; `postponed_s` after it was
        asked for): start it again once the delay is over."""
        self.due[rank] = time.monotonic() + self.delay_s
        incarnation = 1 + sum(r["rank"] == rank for r in self.records)
        self.records.append(
            {
                "rank": rank,
                "cause": cause,
                "killed_t": time.time(),
                "incarnation": incarnation,
                "postponed_s": postponed_s,
            }
        )

    def expected(self, rank: int) -> bool:
        """Whether `rank` is down on purpose (its exit is not a failure)."""
        return rank in self.due

    def poll(self, procs: dict[int, Any]) -> list[int]:
        """Start the ranks whose delay is over, in `procs`; the ranks started."""
        now = time.monotonic()
        started = [r for r, due in self.due.items() if now >= due]
        for rank in started:
            record = next(r for r in reversed(self.records) if r["rank"] == rank)
            procs[rank].wait()
            procs[rank] = self.start(rank, record["incarnation"])
            record["restarted_t"] = time.time()
            del self.due[rank]
            with self.log_path.open("a") as log:
                log.write(json.dumps({"t": record["restarted_t"], "kind": "fault", "event": "restarted", **record}))
                log.write("\n")
        return started


class FailureSchedule:
    """Random failures (`mtbf_s`): each replica fails after an up time drawn from an exponential distribution of mean
    `mtbf_s`, counted from its start or restart, from a stream of its own seeded by (seed, replica), so one
    replica's failures do not shift another's (`seed`: "failure_seed:run seed", so a study's seeds differ). A
    failure that would leave fewer than `min_replicas` replicas up waits until one is back. `now`: time.monotonic().
    """

    def __init__(self, mtbf_s: float, seed: str, replicas: int, min_replicas: int, now: float):
        self.mtbf_s, self.min_replicas = mtbf_s, min_replicas
        self.streams = {r: random.Random(f"{seed}:{r}") for r in range(replicas)}
        self.due_at = {r: now + self._draw(r) for r in range(replicas)}

    def _draw(self, replica: int) -> float:
        return self.streams[replica].expovariate(1.0 / self.mtbf_s)

    def due(self, now: float, down: set[int]) -> list[int]:
        """The replicas to kill now, of those up, earliest first, while at least min_replicas stay up."""
        up = [r for r in sorted(self.due_at, key=self.due_at.get) if r not in down]
        failing = [r for r in up if self.due_at[r] <= now]
        return failing[: max(0, len(up) - self.min_replicas)]

    def restarted(self, replica: int, now: float) -> None:
        self.due_at[replica] = now + self._draw(replica)


class LighthouseExited(Exception):
    """The lighthouse stopped under the run; the message says how."""


class Tolerance:
    """A run's torchft side in the runner: the lighthouse, a process in cluster 0's namespace, and the restarts of
    killed ranks. `start_rank(rank, incarnation)` starts a rank's worker; `paths` is the run folder's RunPaths."""

    def __init__(self, config: Any, cluster: Any, start_rank: Callable[[int, int], Any], paths: Any):
        argv = [
            sys.executable,
            "-m",
            "harness.run.fault_tolerance",
            "--min-replicas",
            str(config.fault_tolerance.min_replicas),
            "--join-timeout-s",
            str(config.collective_timeout_s),
            "--run-dir",
            str(paths.root),
        ]
        self.log_path = paths.logs_dir / "lighthouse.log"
        self.lighthouse = cluster.spawn(0, argv, {"PYTHONUNBUFFERED": "1"}, self.log_path)
        self.restarts = Restarts(config.fault_tolerance.restart_delay_s, start_rank, paths.faults)
        ft = config.fault_tolerance
        self.schedule = (
            FailureSchedule(
                ft.mtbf_s, f"{ft.failure_seed}:{config.train.seed}", config.clusters, ft.min_replicas, time.monotonic()
            )
            if ft.mtbf_s is not None
            else None
        )
        self.paths, self.replicas, self.min_replicas = paths, config.clusters, ft.min_replicas
        # Restarted ranks not yet healed, each with the events that will say so (those after its restart).
        self.rejoining: dict[int, EventTail] = {}
        # Restarted ranks that found nobody to heal from (the others had finished): down for good.
        self.left: set[int] = set()
        # Kills asked for while they would leave fewer than min_replicas training: (rank, cause, asked at).
        self.postponed: list[tuple[int, str, float]] = []

    def down(self) -> set[int]:
        """The replicas not training now: killed and not restarted yet, restarted and not healed yet, or gone."""
        return set(self.restarts.due) | set(self.rejoining) | self.left

    def kill(self, procs: dict[int, Any], rank: int, cause: str = "fault") -> None:
        """Kill `rank` (`cause`: a --fault kill, or "mtbf" for a random failure) and have it started again after
        the delay. A kill that would leave fewer than min_replicas replicas training (a rank down is not training
        until it has healed) waits until one is back; its restart record says how long (`postponed_s`)."""
        self.postponed.append((rank, cause, time.monotonic()))
        self._kill_what_may_go(procs)

    def _kill_what_may_go(self, procs: dict[int, Any]) -> None:
        for entry in list(self.postponed):
            rank, cause, asked = entry
            down = self.down()
            if rank in down or self.replicas - len(down) - 1 < self.min_replicas:
                continue
            self.postponed.remove(entry)
            procs[rank].kill()
            self.restarts.killed(rank, cause, postponed_s=time.monotonic() - asked)

    def _follow_rejoins(self) -> None:
        """A restarted rank is back once its events show its heal (a quorum that healed it) or that it left."""
        for rank, tail in list(self.rejoining.items()):
            for event in tail:
                if event["kind"] == "left":
                    self.left.add(rank)
                if event["kind"] == "left" or (event["kind"] == "quorum" and "healed_to_step" in event):
                    del self.rejoining[rank]
                    break

    def poll(self, procs: dict[int, Any], then: Callable[[], None] | None = None) -> None:
        """Restart what is due; a lighthouse that exited ends the run (no quorum can form without it). `then`: what
        else the runner polls (the live scalar writers)."""
        now = time.monotonic()
        self._follow_rejoins()
        for rank in self.restarts.poll(procs):
            events = self.paths.events(rank)
            self.rejoining[rank] = EventTail(events, offset=events.stat().st_size if events.exists() else 0)
            if self.schedule is not None:
                self.schedule.restarted(rank, now)
        self._kill_what_may_go(procs)
        # Once a replica has finished, the run is ending: a replica killed now could not rejoin a round.
        if self.schedule is not None and not any(proc.poll() == 0 for proc in procs.values()):
            for rank in self.schedule.due(now, self.down()):
                self.kill(procs, rank, cause="mtbf")
        if then is not None:
            then()
        code = self.lighthouse.poll()
        if code is not None:
            raise LighthouseExited(f"the torchft lighthouse exited with code {code}; see {self.log_path}")

    def stop(self) -> None:
        stop_process(self.lighthouse, STOP_GRACE_S)


def _heal(restart: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    """One failure, killed to healed, from the runner's restart record and the restarted rank's events."""
    restarted_t = restart.get("restarted_t")
    healed = next(
        (
            e
            for e in events
            if e["kind"] == "quorum" and "healed_to_step" in e and restarted_t is not None and e["t"] >= restarted_t
        ),
        None,
    )
    trained = [e["step"] for e in events if e["kind"] == "step" and e["t"] <= restart["killed_t"]]
    return {
        "rank": restart["rank"],
        "incarnation": restart["incarnation"],
        "cause": restart.get("cause", "fault"),
        # The step it was training when killed: the one after its last logged step.
        "killed_at_step": max(trained) + 1 if trained else 0,
        # How long the kill waited for min_replicas others to be training (0: killed when asked).
        "postponed_s": restart.get("postponed_s", 0.0),
        "down_s": restarted_t - restart["killed_t"] if restarted_t is not None else None,
        # From the restart to the heal applied: the worker's start, its wait for the others' next round, the fetch.
        "heal_s": healed["t"] - restarted_t if healed else None,
        "healed_to_step": healed["healed_to_step"] if healed else None,
        "heal_state_bytes": healed["heal_state_bytes"] if healed else None,
        "heal_received_bytes": healed["heal_received_bytes"] if healed else None,
    }


def _left(events: list[dict[str, Any]]) -> bool:
    return any(e["kind"] == "left" for e in events)


def _applied_tokens(events: dict[int, list[dict[str, Any]]], clusters: int) -> int | None:
    """Tokens in the final model: each committed round's steps times the replicas in its quorum, from the `commit`
    events of every rank (each participant logs its rounds; a rank that died logged those before), each round once.
    A discarded round has no commit event."""
    start = next((e for rank_events in events.values() for e in rank_events if e["kind"] == "start"), None)
    if start is None:
        return None
    rounds: dict[int, tuple[int, int]] = {}
    for rank_events in events.values():
        for e in rank_events:
            if e["kind"] == "commit":
                rounds[e["from_step"]] = (e["to_step"], max(e["participants"], rounds.get(e["from_step"], (0, 0))[1]))
    replica_steps = sum(participants * (to_step - from_step) for from_step, (to_step, participants) in rounds.items())
    return replica_steps * (start["tokens_per_step"] // clusters)


def _training_wall_s(events: dict[int, list[dict[str, Any]]]) -> float | None:
    """From the first step's start to the last step's end on any rank: the whole run, failures and heals included."""
    steps = [e for rank_events in events.values() for e in rank_events if e["kind"] == "step"]
    if not steps:
        return None
    return max(e["t"] for e in steps) - min(e["t"] - e["step_s"] for e in steps)


def summarize_fault_tolerance(
    config: Any, events: dict[int, list[dict[str, Any]]], record: dict[str, Any]
) -> dict[str, Any]:
    """summary.json's fault-tolerance figures: each failure's downtime, time and bytes to heal, the rounds
    discarded, and goodput: tokens in the final model over the training's whole wall time on every rank."""
    if not config.fault_tolerance.enabled:
        return {}
    heals = [_heal(r, events.get(r["rank"], [])) for r in record.get("restarts") or []]
    discarded = [e for rank_events in events.values() for e in rank_events if e["kind"] == "discarded"]
    applied = _applied_tokens(events, config.clusters)
    wall_s = _training_wall_s(events)
    every_step = config.clusters * config.train.steps
    start = next((e for rank_events in events.values() for e in rank_events if e["kind"] == "start"), None)
    return {
        "fault_tolerance": config.fault_tolerance.engine,
        "heals": heals,
        # Replicas restarted after the others had finished: nothing was left to rejoin (trainers/train.py).
        "replicas_left": [rank for rank, rank_events in sorted(events.items()) if _left(rank_events)],
        "rounds_discarded": len(discarded),
        "steps_discarded": sum(e["to_step"] - e["from_step"] for e in discarded),
        "ft_applied_tokens": applied,
        # Of the tokens every replica would have trained had none failed: what the failures cost in data.
        "ft_applied_fraction": (
            applied / (every_step * (start["tokens_per_step"] // config.clusters)) if applied is not None else None
        ),
        "ft_wall_s": wall_s,
        "goodput_tokens_per_s": applied / wall_s if applied is not None and wall_s else None,
    }


def main() -> int:
    """The lighthouse: torchft's quorum server, until SIGTERM."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--min-replicas", type=int, required=True)
    parser.add_argument("--join-timeout-s", type=float, required=True)
    # The run it serves: its command line names the run as its workers' do (a test finds a run's processes by it).
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args()
    # No lighthouse outlives its run, however the harness dies.
    set_parent_death_signal(signal.SIGKILL)
    from torchft.coordination import LighthouseServer

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    lighthouse = LighthouseServer(
        bind=f"[::]:{LIGHTHOUSE_PORT}",
        min_replicas=args.min_replicas,
        # A live replica that has not asked yet (it is inside its round) is waited for this long: rounds are
        # synchronous, so a quorum without it would leave it to heal. A dead one is dropped after its heartbeats
        # stop (torchft's 5 s).
        join_timeout_ms=int(args.join_timeout_s * 1000),
        quorum_tick_ms=100,
    )
    print(f"lighthouse of {args.run_dir} on port {LIGHTHOUSE_PORT}", flush=True)
    while not stop:
        time.sleep(0.2)
    lighthouse.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
