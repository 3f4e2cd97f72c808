"""Real multi-process runs for method tests: forked ranks joined over gloo on 127.0.0.1.

Forked, not spawned: a spawned rank imports torch again and, at its first optimizer, torch._dynamo (torch.optim
imports it there), ~3 s of CPU a rank that a fork inherits from the test process instead (the method and trainer
tests took 150 s with spawned ranks, 64 s forked, two at a time). The test process may have run torch ops on an
OpenMP pool a fork does not carry over: each rank sets one intra-op thread before any op, so it never enters one."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401 - imported once here for every forked rank (see above)
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, scenario, args: tuple, out_dir: Path) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    # A short timeout turns a deadlock (a pipeline schedule, a mismatched collective) into a failed test, not a hang.
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        torch.save(scenario(rank, *args), out_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    # The results are on disk. Skip the interpreter's teardown: on a loaded machine it sometimes aborts the
    # process after gloo use ("terminate called without an active exception"), failing a test that passed.
    os._exit(0)


def run_ranks(scenario, args: tuple, out_dir: Path, world: int = 2) -> list:
    """Run `scenario(rank, *args)` on `world` ranks; returns what each rank returned, in rank order.

    `scenario` runs in each forked rank inside the default process group, so it can use `dist.group.WORLD`,
    `dist.get_world_size()` and `dist.new_group`.
    """
    mp.start_processes(
        _rank, args=(world, free_port(), scenario, args, out_dir), nprocs=world, join=True, start_method="fork"
    )
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


def run_scenarios(scenarios, out_dir: Path, world: int = 2) -> dict[str, list]:
    """Run `scenarios(rank)`, a function returning {scenario name: result}, on `world` ranks started once (each start
    forks the ranks and joins a process group); returns scenario name -> each rank's result, in rank order."""
    results = run_ranks(scenarios, (), out_dir, world)
    return {name: [out[name] for out in results] for name in results[0]}
