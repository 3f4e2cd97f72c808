"""The process each rank runs: join torch.distributed, build the groups, train (or calibrate), log.

It follows torchrun's contract (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment), so the same worker
runs under the harness's backends and under torchrun on real hosts. The run's config.json says the rest.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from harness.net.counters import LinkCounter, tcp_counters
from harness.net.topology import Topology
from harness.process import set_parent_death_signal
from harness.run.config import RunConfig
from harness.run.events import EventWriter
from harness.run.fault_tolerance import group_ports, lighthouse_url
from harness.run.folder import RunPaths, write_rank_result
from trainers.comm import allreduce_payload_bytes
from trainers.fault_tolerance import ManagedGroup
from trainers.train import Checkpointing, NothingToRejoin, ParallelContext, train


def _die_with_parent() -> None:
    """Ask the kernel to kill this worker if the harness dies, even by SIGKILL, so no rank outlives its run."""
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() == 1:
        sys.exit("harness exited before this worker started")


def device_and_backend(rank: int, world_size: int) -> tuple[torch.device, str]:
    """CUDA with NCCL where there is a GPU (one per rank, by LOCAL_RANK as torchrun sets it), else CPU with gloo.

    HARNESS_DEVICE=cpu forces the CPU; HARNESS_DIST_BACKEND=gloo keeps CUDA tensors but talks over gloo (NCCL
    refuses two ranks on one GPU, so when the ranks on this host outnumber its GPUs, gloo is the default).
    """
    if torch.cuda.is_available() and os.environ.get("HARNESS_DEVICE", "cuda") != "cpu":
        gpus = torch.cuda.device_count()
        index = int(os.environ.get("LOCAL_RANK", rank)) % gpus
        torch.cuda.set_device(index)
        # Measured on a one-GPU H200 host: NCCL 2.28 fails with "Duplicate GPU detected" for two ranks on one device.
        shared = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) > gpus
        return torch.device("cuda", index), os.environ.get("HARNESS_DIST_BACKEND", "gloo" if shared else "nccl")
    return torch.device("cpu"), os.environ.get("HARNESS_DIST_BACKEND", "gloo")


def build_groups(topology: Topology, rank: int, device: torch.device) -> ParallelContext:
    """Every rank must create every group, in the same order (torch.distributed's rule)."""
    pipeline_group = data_parallel_group = None
    for cluster in range(topology.clusters):
        ranks = topology.pipeline_ranks(cluster)
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            pipeline_group = group
    for stage in range(topology.stages):
        ranks = topology.data_parallel_ranks(stage)
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            data_parallel_group = group
    return ParallelContext(
        rank=rank,
        cluster=topology.cluster_of(rank),
        clusters=topology.clusters,
        stage=topology.stage_of(rank),
        stages=topology.stages,
        pipeline_group=pipeline_group,
        data_parallel_group=data_parallel_group,
        device=device,
    )


def join_replica_group(
    config: RunConfig,
    topology: Topology,
    rank: int,
    device: torch.device,
    backend: str,
    log: EventWriter,
    counter: LinkCounter | None,
) -> ParallelContext:
    """Under fault tolerance (harness/run/fault_tolerance.py): this cluster's own process group, and torchft's
    Manager as the data-parallel group across clusters, advertised at the cluster's address so that quorum, exchange
    and heal all cross the shaped link. A restarted rank (HARNESS_INCARNATION > 0) listens on fresh ports."""
    cluster = topology.cluster_of(rank)
    incarnation = int(os.environ.get("HARNESS_INCARNATION", "0"))
    group_port, store_port, manager_port = group_ports(incarnation)
    address = topology.cluster_address(cluster)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}:{group_port}",
        rank=topology.stage_of(rank),
        world_size=topology.stages,
        timeout=datetime.timedelta(seconds=config.collective_timeout_s),
    )
    managed = ManagedGroup(
        replica=cluster,
        address=address,
        lighthouse=lighthouse_url(topology.cluster_address(0)),
        store_port=store_port,
        manager_port=manager_port,
        min_replicas=config.fault_tolerance.min_replicas,
        timeout_s=config.fault_tolerance.replica_timeout_s,
        # A rejoining replica waits for the others' next round: as long as a collective may take.
        quorum_timeout_s=config.collective_timeout_s,
        log=log,
        received_bytes=counter.rx_bytes if counter else None,
        rejoining=incarnation > 0,
    )
    return ParallelContext(
        rank=rank,
        cluster=cluster,
        clusters=topology.clusters,
        stage=topology.stage_of(rank),
        stages=topology.stages,
        pipeline_group=None,
        data_parallel_group=managed,
        device=device,
    )


def calibration_bytes(rate_bps: int | None) -> int:
    """A buffer that takes about a second per all-reduce at the configured rate (1-64 MiB)."""
    if rate_bps is None:
        return 64 << 20
    return int(min(64 << 20, max(1 << 20, rate_bps / 8)))


def calibrate(
    group: dist.ProcessGroup, rate_bps: int | None, device: torch.device, log: EventWriter, iterations: int = 3
) -> float:
    """All-reduce bus bandwidth across the clusters, nccl-tests' definition: busbw = algbw * 2(n-1)/n."""
    n = dist.get_world_size(group)
    nbytes = calibration_bytes(rate_bps)
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dist.all_reduce(buf, group=group)  # warm-up: connections and buffers
    times = []
    for _ in range(iterations):
        dist.barrier(group=group)
        started = time.perf_counter()
        dist.all_reduce(buf, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # NCCL returns at enqueue; time the transfer, not the launch
        times.append(time.perf_counter() - started)
    elapsed = statistics.median(times)
    busbw_bps = nbytes * 8 / elapsed * 2 * (n - 1) / n
    log(
        {
            "kind": "calibration",
            "bytes": nbytes,
            "iterations": iterations,
            "times_s": times,
            "busbw_bps": busbw_bps,
            "payload_bytes_per_rank": allreduce_payload_bytes(nbytes, n),
        }
    )
    return busbw_bps


def _with_fault(log: EventWriter, rank: int, spec: str):
    """Failure injection for the teardown tests: HARNESS_FAULT=RANK:STEP raises in that rank after that step."""
    fault_rank, fault_step = (int(x) for x in spec.split(":"))

    def log_then_fail(event: dict) -> None:
        log(event)
        if rank == fault_rank and event.get("kind") == "step" and event["step"] == fault_step:
            # Shaped like gloo's errors, which open with "[/path/pair.cc:NNN]": failure text must print as text.
            raise RuntimeError(f"[/harness/run/worker.py:fault] injected fault (HARNESS_FAULT={spec})")

    return log_then_fail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True)
    args = parser.parse_args()
    _die_with_parent()

    paths = RunPaths(args.run_dir)
    config = RunConfig.load(paths.config)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    topology = Topology(config.clusters, config.stages)
    writer = log = EventWriter(paths.events(rank), rank=rank)
    # Ranks share the machine's cores; more threads than cores per rank only adds contention.
    torch.set_num_threads(config.train.threads_per_rank or max(1, (os.cpu_count() or 1) // world_size))
    try:
        device, backend = device_and_backend(rank, world_size)
        counter = None
        if topology.stage_of(rank) == 0 and os.environ.get("HARNESS_UPLINK"):
            counter = LinkCounter(os.environ["HARNESS_UPLINK"])
        if config.fault_tolerance.enabled:
            par = join_replica_group(config, topology, rank, device, backend, writer, counter)
        else:
            dist.init_process_group(
                backend,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=config.collective_timeout_s),
            )
            par = build_groups(topology, rank, device)
        if os.environ.get("HARNESS_FAULT"):
            log = _with_fault(log, rank, os.environ["HARNESS_FAULT"])
        result: dict = {"device": str(device), "dist_backend": backend}
        # Under `harness calibrate` the TCP counters are the ring all-reduce's; in training, the training's alone.
        tcp_before = tcp_counters() if counter else None
        if (config.mode == "calibrate" or config.calibrate) and par.data_parallel_group is not None:
            if par.stage == 0:
                result["link_busbw_bps"] = calibrate(
                    par.data_parallel_group, config.profile.inter_cluster.rate_bps, par.device, log
                )
            dist.barrier()
            if config.mode == "train" and counter:
                tcp_before = tcp_counters()
        if config.mode == "train":
            result.update(
                train(
                    config.train,
                    config.method,
                    config.method_config,
                    par,
                    log,
                    counter.tx_bytes if counter else None,
                    Checkpointing(paths.checkpoints, config.checkpoint_every),
                )
            )
        # The rank's largest resident set (Linux reports ru_maxrss in KiB): what emulating a site costs the host.
        result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if tcp_before is not None:
            tcp_after = tcp_counters()
            result["tcp_out_segments"] = tcp_after["OutSegs"] - tcp_before["OutSegs"]
            result["tcp_retransmitted_segments"] = tcp_after["RetransSegs"] - tcp_before["RetransSegs"]
        write_rank_result(args.run_dir, rank, result)
        if isinstance(par.data_parallel_group, ManagedGroup):
            par.data_parallel_group.shutdown()
        dist.destroy_process_group()
        return 0
    except NothingToRejoin as err:
        # Not a failure: the run ended while this replica was down. It leaves no result (summary.py counts it out).
        writer({"kind": "left", "reason": str(err)})
        return 0
    except Exception as err:
        writer({"kind": "error", "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})
        traceback.print_exc()
        return 1
    finally:
        writer.close()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Results are on disk. Under load, gloo's threads have aborted interpreter shutdown ("terminate called without
    # an active exception"), which would turn a finished rank into a SIGABRT; leave without that shutdown.
    os._exit(code)
