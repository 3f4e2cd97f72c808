"""One run, start to end: validate, build the cluster, start the ranks, watch them, tear down, summarize.

Everything a user can get wrong is checked in `validate` before anything is created on the host. After that,
teardown is unconditional: workers are stopped and the cluster removed on success, on a failed rank, on Ctrl-C and
on SIGTERM, and the results folder is finalized with status "ok" or "failed" either way.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.backends import ClusterBackend, Worker, make_backend
from harness.config import RunConfig
from harness.errors import UserError
from harness.events import EventTail, read_events
from harness.results import DEFAULT_RUNS_DIR, RunFolder, environment, summarize
from harness.shaping import probe_qdiscs
from harness.topology import Topology
from harness.units import format_rate

MASTER_PORT = 29500
# How long a stopped worker gets to exit before SIGKILL.
STOP_GRACE_S = 3.0
# How long the consequences of a failed rank (its peers' connection errors) get to land before blame is assigned.
FAILURE_SETTLE_S = 1.0


class RunError(UserError):
    """Bad input, found before anything was created."""


class Interrupted(Exception):
    """SIGINT or SIGTERM reached the harness."""


def validate(config: RunConfig, out: Path | None) -> RunFolder:
    """Check everything the user chose, in one place, before the host is touched; returns the results folder."""
    config.validate()
    if config.backend == "docker":
        try:
            from harness.backends.docker import unavailable_reason
        except ImportError:
            raise RunError("the docker backend needs the docker SDK; pip install 'harness[docker]'") from None
        reason = unavailable_reason(config.clusters * config.stages, config.gpus)
        if reason:
            raise RunError(reason)
    elif config.backend != "netns":
        raise RunError(f"backend {config.backend!r} is not available; use --backend netns or --backend docker")
    if config.profile.needs_netem and not probe_qdiscs(os.geteuid() != 0)["netem"]:
        raise RunError(
            f"profile {config.profile.name!r} asks for delay, jitter or loss, but this kernel has no "
            "sch_netem; load it (modprobe sch_netem) or use a rate-only profile"
        )
    folder = RunFolder(out or DEFAULT_RUNS_DIR / config.run_id)
    folder.check()
    return folder


_RUNNER_PID = os.getpid()


def _raise_interrupted(signum: int, frame: Any) -> None:
    # pyroute2 forks helpers into namespaces; they inherit this handler and must just die, not finalize the run.
    if os.getpid() != _RUNNER_PID:
        os._exit(128 + signum)
    raise Interrupted(signal.Signals(signum).name)


def _describe_exit(rank: int, code: int, topology: Topology, run_dir: Path) -> str:
    where = f"rank {rank} (cluster {topology.cluster_of(rank)}, stage {topology.stage_of(rank)})"
    if code < 0:
        return f"{where} was killed by {signal.Signals(-code).name}"
    errors = [e for e in read_events(run_dir / "events" / f"rank{rank}.jsonl") if e["kind"] == "error"]
    reason = f": {errors[-1]['error']}" if errors else f"; see logs/rank{rank}.log"
    return f"{where} exited with code {code}{reason}"


def run(
    config: RunConfig, out: Path | None = None, on_progress: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Run one benchmark; returns summary.json's content (with "results_dir")."""
    folder = validate(config, out)
    topology = Topology(config.clusters, config.stages)
    cluster = make_backend(config.backend, config.run_key, topology, config.profile, config.gpus)
    run_dir = folder.create()
    config.save(run_dir / "config.json")
    (run_dir / "logs").mkdir()
    procs: dict[int, Worker] = {}
    failure: str | None = None
    record: dict[str, Any] = {}
    qdiscs: list[dict] = []
    previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        cluster.up()
        record["cluster_setup_s"] = cluster.setup_s
        qdiscs = cluster.kernel_qdiscs()
        wire_before = cluster.wire_bytes()
        for rank in range(topology.world_size):
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(topology.world_size),
                "MASTER_ADDR": topology.master_address,
                "MASTER_PORT": str(MASTER_PORT),
                "PYTHONUNBUFFERED": "1",
            }
            argv = [sys.executable, "-m", "harness.worker", "--run-dir", str(run_dir)]
            procs[rank] = cluster.spawn(rank, argv, env, run_dir / "logs" / f"rank{rank}.log")
        failure = _watch(procs, topology, run_dir, config, cluster, on_progress)
        record["wire_bytes_run"] = cluster.wire_bytes() - wire_before
    except Interrupted as sig:
        failure = f"interrupted by {sig} during the run"
    except Exception as err:
        failure = f"harness error: {type(err).__name__}: {err}"
        raise
    finally:
        try:
            _stop(procs)
            cluster.down()
            record["cluster_teardown_s"] = getattr(cluster, "teardown_s", None)
            summary = summarize(config, run_dir, failure, record)
            folder.write_json(
                "environment.json",
                environment(
                    {
                        "backend": config.backend,
                        "applied_qdiscs": cluster.applied_qdiscs,
                        "kernel_qdiscs": qdiscs,
                    }
                ),
            )
            folder.write_json("summary.json", summary)
            final = folder.commit()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    summary["results_dir"] = str(final)
    return summary


def _watch(
    procs: dict[int, Worker],
    topology: Topology,
    run_dir: Path,
    config: RunConfig,
    cluster: ClusterBackend,
    on_progress: Callable[[dict[str, Any]], None] | None,
) -> str | None:
    """Wait for every rank; a rank that fails fails the run (the others would hang in collectives)."""
    tail = EventTail(run_dir / "events" / f"rank{topology.world_size - 1}.jsonl")
    last_wire, last_t = cluster.wire_bytes(), time.monotonic()
    latest: dict[str, Any] = {}
    while True:
        if any(p.poll() not in (None, 0) for p in procs.values()):
            return _first_failure(procs, topology, run_dir)
        if all(p.poll() == 0 for p in procs.values()):
            return None
        time.sleep(0.25)
        if on_progress is None:
            continue
        for event in tail:
            if event["kind"] == "step":
                latest.update(event)
            elif event["kind"] == "eval":
                latest["val_loss"] = event["val_loss"]
        now, wire = time.monotonic(), cluster.wire_bytes()
        rate = config.profile.inter_cluster.rate_bps
        link_bps = (wire - last_wire) * 8 / max(now - last_t, 1e-6)
        last_wire, last_t = wire, now
        on_progress(
            {
                **latest,
                "total_steps": config.train.steps,
                "link_bps": link_bps,
                "link_utilisation": link_bps / (rate * topology.clusters) if rate else None,
                "link": format_rate(rate) if rate else "unshaped",
            }
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
        errors = [e["t"] for e in read_events(run_dir / "events" / f"rank{rank}.jsonl") if e["kind"] == "error"]
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
