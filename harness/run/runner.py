"""One run, start to end: validate, build the cluster, start the ranks, watch them, tear down, summarize.

Everything a user can get wrong is checked in `validate` before anything is created on the host. After that,
teardown is unconditional: workers are stopped and the cluster removed on success, on a failed rank, on Ctrl-C and
on SIGTERM, and the results folder is finalized with status "ok" or "failed" either way.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.backends import ClusterBackend, Worker, capabilities, make_backend, unavailable_reason
from harness.errors import UserError
from harness.lock import RunLock
from harness.net.delayline import tun_unavailable_reason
from harness.net.linkprobe import LinkCheckFailed, check_link, loaded_link
from harness.net.shaping import probe_qdiscs
from harness.net.topology import Topology
from harness.net.trace import replays_delay
from harness.run.config import RunConfig
from harness.run.events import EventTail
from harness.run.fault_tolerance import LighthouseExited, Tolerance
from harness.run.faults import FaultInjector
from harness.run.folder import DEFAULT_RUNS_DIR, RunFolder, RunPaths, UnreadableResults, read_events
from harness.run.host_cpu import HostCpuMeter
from harness.run.linktrace import TraceReplay
from harness.run.resume import checked_resume, previous_record, rewind_events
from harness.run.summary import environment, summarize
from harness.run.tensorboard import LiveScalars, RunScalars
from harness.units import format_rate

MASTER_PORT = 29500
# How long a stopped worker gets to exit before SIGKILL.
STOP_GRACE_S = 3.0
# How long the consequences of a failed rank (its peers' connection errors) get to land before blame is assigned.
FAILURE_SETTLE_S = 1.0


class RunError(UserError):
    """Bad input, found before anything was created."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the harness. A BaseException, as KeyboardInterrupt is: no `except Exception` on
    the way (a backend's, a library's) may swallow it."""


@dataclass(frozen=True)
class CheckedRun:
    """A run whose every choice has been checked (`validate`), with what the checks resolved: ready to `execute`."""

    config: RunConfig
    folder: RunFolder
    # What adds the profile's delay, jitter and loss ("netem", "userspace"), or None when it asks for none.
    link_emulator: str | None
    # An interrupted run continued in its folder (harness/run/resume.py): the checkpoint's step it resumes from.
    resume_step: int | None = None


def validate(config: RunConfig, out: Path | None) -> CheckedRun:
    """Check everything the user chose, in one place, before the host is touched."""
    link_emulator = _validate_config(config)
    folder = RunFolder(out or DEFAULT_RUNS_DIR / config.run_id)
    folder.check()
    return CheckedRun(config, folder, link_emulator)


def validate_resume(run_dir: Path) -> CheckedRun:
    """An interrupted run to continue in its folder from its latest checkpoint (harness/run/resume.py), checked as
    a new run is, before the host is touched."""
    config, folder, step = checked_resume(run_dir)
    return CheckedRun(config, folder, _validate_config(config), resume_step=step)


def _validate_config(config: RunConfig) -> str | None:
    """The config's own checks and the host's; the link emulator they resolve."""
    config.validate()
    link_emulator = resolve_link_emulator(config)
    if not (math.isfinite(config.collective_timeout_s) and config.collective_timeout_s > 0):
        raise RunError(
            f"the collective timeout must be a positive number of seconds, got {config.collective_timeout_s}"
        )
    reason = unavailable_reason(config.backend, config.clusters * config.stages, config.gpus)
    if reason:
        raise RunError(reason)
    return link_emulator


def resolve_link_emulator(config: RunConfig) -> str | None:
    """What will add the profile's delay, jitter and loss: "netem", "userspace", or None when it asks for none.

    auto takes netem where the kernel has it, else the userspace delay line; a choice the machine cannot honour is
    refused here, before the host is touched. `userspace` puts the delay line in the path even for a profile with
    no delay (its zero-delay baseline: comparing RTTs with the same forwarding cost in every run). A trace with a
    delay column takes the delay line whatever the choice: only it replays a delay schedule; so does a loss model.
    """
    profile = config.profile
    choice = config.link_emulator
    if profile.trace is not None and replays_delay(profile.trace):
        if choice == "netem":
            raise RunError(
                f"profile {profile.name!r} replays a delay trace, which only the userspace delay line does (netem is "
                "not changed under a run); use --link-emulator userspace or auto"
            )
        choice = "userspace"
    if profile.has_loss_model:
        if profile.intra_cluster.loss_model is not None:
            raise RunError(
                f"profile {profile.name!r} gives its intra-cluster link a loss model, which only the delay line "
                "between clusters runs; remove it or move it to inter_cluster"
            )
        if choice == "netem" or not capabilities(config.backend).userspace_delay_line:
            raise RunError(
                f"profile {profile.name!r} has bursty loss (a loss model), which only the userspace delay line runs "
                "(pyroute2's netem encoder sends no Gilbert-Elliott parameters); use --backend netns with "
                "--link-emulator userspace or auto"
            )
        choice = "userspace"
    if not profile.needs_netem and choice != "userspace":
        return None
    has_netem = probe_qdiscs(os.geteuid() != 0)["netem"]
    if choice == "netem" and not has_netem:
        raise RunError(
            "--link-emulator netem needs sch_netem, which this kernel lacks; load it (modprobe sch_netem) or use "
            "--link-emulator userspace (or auto)"
        )
    if choice == "netem" or (choice == "auto" and has_netem):
        return "netem"
    if not capabilities(config.backend).userspace_delay_line:
        raise RunError(
            "--link-emulator userspace exists for the netns backend only; use --backend netns, or netem on a kernel "
            "that has it"
            if choice == "userspace"
            else f"profile {profile.name!r} asks for delay, jitter or loss, this kernel has no sch_netem and the "
            f"{config.backend} backend has no userspace delay line; use --backend netns or a kernel with sch_netem"
        )
    if profile.intra_cluster.needs_netem:
        raise RunError(
            f"profile {profile.name!r} sets delay, jitter or loss on its intra-cluster link, which only netem "
            "can emulate (the delay line sits between clusters); remove them or use a kernel with sch_netem"
        )
    # Here, in the CLI's validation before the user-namespace re-exec, the check runs as the real user.
    reason = tun_unavailable_reason()
    if reason:
        raise RunError(reason)
    return "userspace"


# The watchdog: a run whose ranks log nothing for max(collective timeout, this many x the slowest step so far) is
# stuck (a stopped or wedged rank that no collective timeout catches, e.g. SIGSTOP) and is failed.
STALL_STEP_FACTOR = 10
# How often the watcher polls the ranks and their events, and how often it checks that the cluster is still there.
POLL_S = 0.25
# How often the progress display reads the wire counter: each read decodes netlink messages on cores that train.
PROGRESS_S = 1.0
INTACT_CHECK_S = 2.0
# A worker the kernel has kept stopped (SIGSTOP, a debugger) this long fails the run at once: /proc shows it, and
# no collective timeout would fire before the watchdog's (minutes). Longer than a profiler's brief attach.
STOPPED_FAIL_S = 10.0


class _Signals:
    """SIGINT and SIGTERM during a run interrupt it; once teardown has begun they are only recorded, so teardown
    (stopping workers, removing the cluster, writing the summary) cannot be cut short by a user pressing Ctrl-C
    again and again.

    The handler only records: the runner raises Interrupted itself at points of its choosing (`check`, every poll
    of the watch loop and between set-up steps). A handler that raised wherever the main thread happened to be
    could land inside a callback Python guards (logging's at-fork hook, which runs at every fork pyroute2 makes to
    read a namespace's counters; a finalizer), where the exception is printed and dropped, and the run went on.
    """

    def __init__(self) -> None:
        self.runner_pid = os.getpid()
        self.received: list[str] = []
        self.tearing_down = False

    def __enter__(self) -> _Signals:
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        # pyroute2 forks helpers into namespaces; they inherit this handler and must just die, not finalize the run.
        if os.getpid() != self.runner_pid:
            os._exit(128 + signum)
        self.received.append(signal.Signals(signum).name)

    def check(self) -> None:
        """Raise Interrupted if a signal arrived (and teardown has not begun)."""
        if self.received and not self.tearing_down:
            raise Interrupted(self.received[0])


def _describe_exit(rank: int, code: int, topology: Topology, run_dir: Path) -> str:
    where = _where(rank, topology)
    if code < 0:
        return f"{where} was killed by {signal.Signals(-code).name}"
    errors = _error_events(run_dir, rank)
    reason = f": {errors[-1]['error']}" if errors else f"; see {RunPaths(run_dir).log(rank).relative_to(run_dir)}"
    return f"{where} exited with code {code}{reason}"


def _error_events(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    """The errors a rank logged; none where its events cannot be read (the summary then says why)."""
    try:
        return [e for e in read_events(run_dir, rank) if e["kind"] == "error"]
    except UnreadableResults:
        return []


def _where(rank: int, topology: Topology) -> str:
    return f"rank {rank} (cluster {topology.cluster_of(rank)}, stage {topology.stage_of(rank)})"


def run(
    config: RunConfig, out: Path | None = None, on_progress: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Validate and execute one benchmark; returns summary.json's content (with "results_dir")."""
    return execute(validate(config, out), on_progress)


def execute(checked: CheckedRun, on_progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run a validated benchmark; returns summary.json's content (with "results_dir").

    `summary["interrupted_by"]` names the signal (SIGINT, SIGTERM) that stopped the run, if one did.
    """
    # Held from before anything is created until everything is removed and the results are in place: while it is
    # held, `harness cleanup` leaves this run alone; if the harness dies, however it dies, the kernel releases it.
    with RunLock(checked.config.run_key, staging=checked.folder.staging):
        return _run(checked, on_progress)


def _run(checked: CheckedRun, on_progress: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
    config, folder, emulator = checked.config, checked.folder, checked.link_emulator
    host_cpu = HostCpuMeter()
    run_dir = folder.create()
    paths = folder.paths
    topology = Topology(config.clusters, config.stages)
    cluster = make_backend(
        config.backend,
        config.run_key,
        topology,
        config.profile,
        config.gpus,
        link_emulator=emulator,
        seed=config.train.seed,
        log_dir=paths.logs_dir,
    )
    procs: dict[int, Worker] = {}
    failure: str | None = None
    record: dict[str, Any] = {"link_emulator": emulator, "faults": []}
    injector: FaultInjector | None = None
    tolerance: Tolerance | None = None
    replay: TraceReplay | None = None
    qdiscs: list[dict] = []
    live: LiveScalars | None = None
    with _Signals() as signals:
        try:
            if checked.resume_step is None:
                config.save(paths.config)
                paths.logs_dir.mkdir()
            else:
                record.update(_rewound(paths, checked.resume_step))
            live = _live_scalars(config, run_dir)
            signals.check()
            cluster.up()
            signals.check()
            record["cluster_setup_s"] = cluster.setup_s
            calibrating = config.mode == "calibrate" or config.calibrate
            if (emulator or calibrating) and capabilities(config.backend).link_check and topology.clusters > 1:
                record.update(check_link(cluster, topology, config.profile.path(0, 1), paths.link_check))
                signals.check()
                if calibrating:
                    record.update(loaded_link(cluster, topology, config.profile.path(0, 1)))
                    signals.check()
            qdiscs = cluster.kernel_qdiscs()
            wire = _WireMeter(cluster)
            if config.fault_tolerance.enabled:
                tolerance = Tolerance(config, cluster, functools.partial(_start_rank, cluster, topology, paths), paths)
                record["restarts"] = tolerance.restarts.records
            _spawn_ranks(cluster, topology, paths, procs)
            if config.profile.trace is not None:
                replay = TraceReplay(cluster, run_dir, emulator)
                replay.start()
            kill = functools.partial(tolerance.kill, procs) if tolerance else lambda rank: procs[rank].kill()
            injector = FaultInjector(config.parsed_faults(), cluster, kill, paths.faults)
            record["faults"] = injector.records
            live_poll = live.poll if live else None
            on_poll = functools.partial(tolerance.poll, procs, live_poll) if tolerance else live_poll
            expected = tolerance.restarts.expected if tolerance else lambda rank: False
            failure = _watch(
                procs, topology, run_dir, config, wire, on_progress, signals.check, injector.poll, on_poll, expected
            )
            failure = _with_injected_faults(failure, injector, config.collective_timeout_s)
            if failure is None:
                record["wire_bytes_run"] = wire.total()
        except Interrupted as sig:
            signals.tearing_down = True
            failure = f"interrupted by {sig} during the run"
        except (BackendVanished, LinkCheckFailed, LighthouseExited) as err:
            failure = str(err)
        except Exception as err:
            failure = f"harness error: {type(err).__name__}: {err}"
            raise
        finally:
            signals.tearing_down = True
            record["interrupted_by"] = signals.received[0] if signals.received else None
            summary, final = _teardown(
                config, folder, cluster, procs, failure, record, qdiscs, injector, replay, live, host_cpu, tolerance
            )
    summary["results_dir"] = str(final)
    return summary


def _with_injected_faults(failure: str | None, injector: FaultInjector, timeout_s: float) -> str | None:
    """A failure with the injected faults that may explain it: a killed rank, an outage."""
    if failure is None:
        return None
    killed = [r["rank"] for r in injector.records if r["fault"] == "kill"]
    if killed:
        failure += f" (--fault kill injected on rank {', '.join(map(str, killed))})"
    # Every rank waits on a dead link alike, so the watchdog's blame says nothing; the outage does.
    outage = injector.outage_note(timeout_s)
    return f"{failure} ({outage})" if outage else failure


def _rewound(paths: RunPaths, step: int) -> dict[str, Any]:
    """The folder of an interrupted run made ready to continue from checkpoint `step`: its events rewound, its
    ranks' results and summary gone (this run writes them); what the summary keeps of the runs before."""
    previous = previous_record(paths)
    rewind_events(paths, step)
    for path in (paths.summary, *(paths.rank_result(rank) for rank in paths.event_ranks())):
        path.unlink(missing_ok=True)
    return {"resumed_at_steps": [*previous["resumed_at_steps"], step], "faults_before_resume": previous["faults"]}


def _spawn_ranks(cluster: ClusterBackend, topology: Topology, paths: RunPaths, procs: dict[int, Worker]) -> None:
    """One worker per rank, each added to `procs` as it starts (teardown stops those that did, if one fails)."""
    for rank in range(topology.world_size):
        procs[rank] = _start_rank(cluster, topology, paths, rank)


def _start_rank(
    cluster: ClusterBackend, topology: Topology, paths: RunPaths, rank: int, incarnation: int = 0
) -> Worker:
    """Start rank `rank`'s worker; `incarnation` > 0: its restart under fault tolerance, logged on its own."""
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(topology.world_size),
        "MASTER_ADDR": topology.master_address,
        "MASTER_PORT": str(MASTER_PORT),
        "PYTHONUNBUFFERED": "1",
        "HARNESS_INCARNATION": str(incarnation),
    }
    argv = [sys.executable, "-m", "harness.run.worker", "--run-dir", str(paths.root)]
    log = paths.log(rank) if incarnation == 0 else paths.logs_dir / f"rank{rank}.restart{incarnation}.log"
    return cluster.spawn(rank, argv, env, log)


def _teardown(
    config: RunConfig,
    folder: RunFolder,
    cluster: ClusterBackend,
    procs: dict[int, Worker],
    failure: str | None,
    record: dict[str, Any],
    qdiscs: list[dict],
    injector: FaultInjector | None = None,
    replay: TraceReplay | None = None,
    live: LiveScalars | None = None,
    host_cpu: HostCpuMeter | None = None,
    tolerance: Tolerance | None = None,
) -> tuple[dict[str, Any], Path]:
    """Stop the workers, remove the cluster, write the summary: each step runs even when one before it failed."""
    teardown_errors = []
    steps = [("stopping the workers", lambda: _stop(procs)), ("removing the cluster", cluster.down)]
    if tolerance is not None:
        steps.insert(1, ("stopping the lighthouse", tolerance.stop))
    if injector is not None:
        steps.insert(1, ("ending an injected outage", injector.restore))
    if replay is not None:
        # Before the cluster goes: the replay reads and re-rates its links.
        steps.insert(-1, ("stopping the trace replay", replay.stop))
    if live is not None:
        # After the workers: their last events are in the files by then.
        steps.insert(1, ("writing the last scalars", live.poll))
    for what, step in steps:
        try:
            step()
        except Exception as err:
            teardown_errors.append(f"{what}: {type(err).__name__}: {err}")
    if teardown_errors and failure is None:
        failure = "teardown failed: " + "; ".join(teardown_errors)
    record["cluster_teardown_s"] = getattr(cluster, "teardown_s", None)
    if host_cpu is not None:
        # After the workers and the cluster's tools are reaped: their CPU time is the run's, not the host's other.
        record.update(host_cpu.read())
    summary = summarize(config, folder.staging, failure, record)
    if live is not None:
        # After the summary, which W&B keeps as its run's summary.
        try:
            live.close(summary)
        except Exception as err:
            teardown_errors.append(f"closing the scalar writers: {type(err).__name__}: {err}")
    summary["teardown_errors"] = teardown_errors
    folder.write_environment(
        environment(
            {
                "backend": config.backend,
                "link_emulator": record.get("link_emulator"),
                "applied_qdiscs": cluster.applied_qdiscs,
                "kernel_qdiscs": qdiscs,
            }
        )
    )
    folder.write_summary(summary)
    return summary, folder.commit()


def _live_scalars(config: RunConfig, run_dir: Path) -> LiveScalars | None:
    """The writers of the run's scalars as it trains: TensorBoard (--tensorboard), W&B (--wandb), or none."""
    recorded = config.to_dict()
    scalars = []
    if config.tensorboard:
        scalars.append(RunScalars(RunPaths(run_dir).tensorboard, recorded))
    if config.wandb:
        from harness.run.weights_and_biases import WandbWriter, files_of

        scalars.append(RunScalars(None, recorded, WandbWriter(config.run_id, recorded, files_of(run_dir))))
    return LiveScalars(run_dir, scalars, recorded) if scalars else None


class BackendVanished(Exception):
    """Part of the emulated cluster disappeared under the run; the message says which."""


class _WireMeter:
    """The backend's wire counter since the start of the run; a counter that cannot be read because its namespace
    or container disappeared is reported as that, not as a traceback."""

    def __init__(self, cluster: ClusterBackend):
        self.cluster = cluster
        self.start = self.read()

    def read(self) -> int:
        try:
            return self.cluster.wire_bytes()
        except Exception:
            gone = self.cluster.vanished()
            if gone:
                raise BackendVanished(gone) from None
            raise

    def total(self) -> int:
        return self.read() - self.start


def _watch(
    procs: dict[int, Worker],
    topology: Topology,
    run_dir: Path,
    config: RunConfig,
    wire: _WireMeter,
    on_progress: Callable[[dict[str, Any]], None] | None,
    check_signals: Callable[[], None],
    inject_faults: Callable[[int], None] = lambda steps_done: None,
    on_poll: Callable[[], None] | None = None,
    expected_exit: Callable[[int], bool] = lambda rank: False,
) -> str | None:
    """Wait for every rank; a rank that fails fails the run (the others would hang in collectives), and so does a
    run that makes no progress (the watchdog) or whose cluster disappears. `inject_faults` gets rank 0's completed
    steps at every poll (harness/run/faults.py); `on_poll` runs at every poll too (the live TensorBoard writer)."""
    tails = {rank: EventTail(RunPaths(run_dir).events(rank)) for rank in procs}
    last_event_at = dict.fromkeys(procs, time.monotonic())
    steps_logged = dict.fromkeys(procs, 0)
    slowest_step_s = 0.0
    last_wire, last_t = wire.read(), time.monotonic()
    last_intact_check = last_t
    latest: dict[str, Any] = {}
    stopped_since: dict[int, float] = {}
    while True:
        check_signals()
        if any(p.poll() not in (None, 0) and not expected_exit(rank) for rank, p in procs.items()):
            return _first_failure({r: p for r, p in procs.items() if not expected_exit(r)}, topology, run_dir)
        if all(p.poll() == 0 for p in procs.values()):
            return None
        time.sleep(POLL_S)
        now = time.monotonic()
        for rank, tail in tails.items():
            for event in tail:
                last_event_at[rank] = now
                if event["kind"] == "step":
                    steps_logged[rank] += 1
                    slowest_step_s = max(slowest_step_s, event["step_s"])
                    if rank == topology.world_size - 1:
                        latest.update(event)
                elif event["kind"] == "eval" and rank == topology.world_size - 1:
                    latest["val_loss"], latest["val_step"] = event["val_loss"], event["step"]
        inject_faults(steps_logged[0])
        if on_poll is not None:
            on_poll()
        if now - last_intact_check >= INTACT_CHECK_S:
            last_intact_check = now
            gone = wire.cluster.vanished()
            if gone:
                raise BackendVanished(gone)
        for rank, proc in procs.items():
            if not _stopped(proc):
                stopped_since.pop(rank, None)
            elif now - stopped_since.setdefault(rank, now) > STOPPED_FAIL_S:
                return _stalled({rank: proc}, topology, steps_logged, now - last_event_at[rank])
        stall_s = max(config.collective_timeout_s, STALL_STEP_FACTOR * slowest_step_s)
        if now - max(last_event_at.values()) > stall_s:
            return _stalled(procs, topology, steps_logged, now - max(last_event_at.values()))
        if on_progress is None or now - last_t < PROGRESS_S:
            continue
        total = wire.read()
        rate = config.profile.inter_cluster.rate_bps
        link_bps = (total - last_wire) * 8 / max(now - last_t, 1e-6)
        last_wire, last_t = total, now
        on_progress(
            {
                **latest,
                "total_steps": config.train.steps,
                "link_bps": link_bps,
                "link_utilisation": link_bps / (rate * topology.clusters) if rate else None,
                "link": format_rate(rate) if rate else "unshaped",
            }
        )


def _stopped(proc: Worker) -> bool:
    """Whether the kernel has the worker's process stopped (SIGSTOP, a debugger): state T or t in /proc."""
    pid = getattr(proc, "pid", None)
    if pid is None:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def _stalled(procs: dict[int, Worker], topology: Topology, steps_logged: dict[int, int], idle_s: float) -> str:
    """Name the rank that holds the others up: a stopped process if there is one, else the one furthest behind."""
    stopped = [rank for rank, proc in procs.items() if _stopped(proc)]
    if stopped:
        return f"{_where(stopped[0], topology)} made no progress for {idle_s:.0f} s: its process is stopped"
    behind = min(procs, key=lambda rank: (steps_logged[rank], rank))
    return (
        f"no rank made progress for {idle_s:.0f} s (watchdog: max(collective timeout, {STALL_STEP_FACTOR} x the "
        f"slowest step)); {_where(behind, topology)} logged the fewest steps ({steps_logged[behind]})"
    )


def _first_failure(procs: dict[int, Worker], topology: Topology, run_dir: Path) -> str:
    """The rank whose failure caused the others': its peers fail too, within moments, with connection errors.

    After a short settle, the cause is a rank killed by a signal (it could log nothing), else the rank whose error
    event came first.
    """
    time.sleep(FAILURE_SETTLE_S)
    failed = {rank: code for rank, p in procs.items() if (code := p.poll()) not in (None, 0)}

    def first_sign(rank: int) -> float:
        if failed[rank] < 0:
            return -math.inf
        errors = [e["t"] for e in _error_events(run_dir, rank)]
        return min(errors, default=math.inf)

    cause = min(failed, key=lambda rank: (first_sign(rank), rank))
    return _describe_exit(cause, failed[cause], topology, run_dir)


def _stop(procs: dict[int, Worker]) -> None:
    """SIGTERM every live worker, then SIGKILL what is left after the grace period; reap them all."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
