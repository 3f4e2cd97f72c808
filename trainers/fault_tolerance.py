"""The data-parallel group under fault tolerance: torchft's Manager decides who takes part and heals who rejoins.

With `--set fault_tolerance=torchft` each cluster is a torchft replica group. Its Manager asks the lighthouse (run by
the harness, harness/run/fault_tolerance.py) for a quorum at the start of every round, reconfigures a gloo process group
over the replicas in it, and, when a replica is behind (restarted after a failure), has it fetch the model and
method state from a live peer over HTTP before the round starts. The methods see a `ManagedGroup` where they would
see the torch.distributed group: `all_reduce_sum` averages over the replicas in the quorum, and `commit()` (torchft's
should_commit) says whether the exchange may be applied; a round whose exchange failed is discarded and trained
again (trainers/train.py).

Every quorum, heal and discarded round is logged as an event: what the run's summary reads for time to heal, bytes
moved to heal and steps lost.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

EventLog = Callable[[dict[str, Any]], None]


def torchft_missing() -> str | None:
    """Why torchft cannot be used here, as the fix to make; None where it imports."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        return "fault tolerance runs on torchft, which is not installed; install the extra: pip install -e '.[ft]'"
    return None


def state_bytes(state: Any) -> int:
    """The size of `state` as torch serializes it: what a heal should move across the link, headers aside."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.tell()


class ManagedGroup:
    """A replica group's torchft Manager, as the methods' data-parallel group.

    Args:
        replica: this cluster's index (its replica id, so the lighthouse's order is the clusters').
        address: the cluster's address on the slow link: the Manager, its store and its checkpoint server are
            advertised there, so quorum and healing traffic cross the shaped link.
        lighthouse: the lighthouse's URL (http://ADDRESS:PORT).
        store_port, manager_port: where this replica group's TCPStore and Manager listen (a restarted replica uses
            fresh ones: the dead one's sockets may linger).
        min_replicas: the fewest replicas a round may train with; fewer and the survivors wait.
        timeout_s: how long a collective, a commit or a heal may take before it counts as failed.
        quorum_timeout_s: how long a replica waits for a quorum (a rejoining replica waits for the others' next
            round, so at least a round's time).
        rejoining: this replica was restarted after a failure: it heals from a peer before it trains.
        received_bytes: this cluster's uplink's received-byte counter (the kernel's), read around a heal.
    """

    def __init__(
        self,
        replica: int,
        address: str,
        lighthouse: str,
        store_port: int,
        manager_port: int,
        min_replicas: int,
        timeout_s: float,
        quorum_timeout_s: float,
        log: EventLog,
        rejoining: bool = False,
        received_bytes: Callable[[], int] | None = None,
    ):
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing.http_transport import HTTPTransport

        group = self

        class SiteHTTPTransport(HTTPTransport):
            """torchft's checkpoint server, advertised at the cluster's address: the host name it uses by default
            resolves outside the cluster's network namespace. A fetch (a heal) is counted on the uplink's
            received bytes, around the fetch alone: the quorum's wait for the others' round is not in it."""

            def address(self) -> str:
                return f"http://{address}:{self._server.socket.getsockname()[1]}/checkpoint/"

            def recv_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
                before = group._received_bytes() if group._received_bytes else None
                state = super().recv_checkpoint(*args, **kwargs)
                if before is not None:
                    group.heal_received_bytes = group._received_bytes() - before
                return state

        timeout = timedelta(seconds=timeout_s)
        # The Manager reconfigures this group at every quorum; all_gather runs on it directly (torchft's Manager
        # wraps only the all-reduce).
        self._pg = ProcessGroupGloo(timeout=timeout)
        self._store = TCPStore(address, store_port, is_master=True, wait_for_workers=False)
        self.log, self._received_bytes = log, received_bytes
        self.rejoining = rejoining
        self._load_state: Callable[[dict[str, Any]], None] = lambda state: None
        # The bytes the last heal's fetch received (SiteHTTPTransport), None where no counter is read.
        self.heal_received_bytes: int | None = None
        self._snapshot: dict[str, Any] | None = None
        self.healed_state: dict[str, Any] | None = None
        self.manager = Manager(
            pg=self._pg,
            load_state_dict=self._load,
            state_dict=lambda: self._snapshot,
            min_replica_size=min_replicas,
            # A quorum blocks until it is formed and a heal is applied before the round trains: a rejoining replica
            # starts its first round from its peers' state, not from its own fresh weights.
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=quorum_timeout_s),
            rank=0,
            world_size=1,
            store_addr=address,
            store_port=store_port,
            lighthouse_addr=lighthouse,
            replica_id=f"cluster{replica}",
            port=manager_port,
            hostname=address,
            checkpoint_transport=SiteHTTPTransport(timeout=timeout, num_chunks=0),
            # Every replica starts from the same seed's weights: nothing to synchronize at step 0.
            init_sync=False,
        )

    def _load(self, state: dict[str, Any]) -> None:
        self._load_state(state)
        self.healed_state = state

    def quorum(self, snapshot: dict[str, Any], load: Callable[[dict[str, Any]], None]) -> dict[str, Any] | None:
        """Join the quorum for the round that starts from `snapshot` (this rank's state now, {"step", "model",
        "method"}: a copy, which a rejoining peer may fetch while this rank trains on); after a heal, the peer's
        snapshot, which `load` has put in this rank (its "step" is the round to train next), else None."""
        started = time.perf_counter()
        self._snapshot, self._load_state, self.healed_state = snapshot, load, None
        self.heal_received_bytes = None
        self.manager.start_quorum()
        quorum_s = time.perf_counter() - started
        event: dict[str, Any] = {
            "kind": "quorum",
            "step": snapshot["step"],
            "participants": self.manager.num_participants(),
            "quorum_s": quorum_s,
        }
        if self.healed_state is not None:
            event.update(
                healed_to_step=self.healed_state["step"],
                heal_state_bytes=state_bytes(self.healed_state),
                heal_received_bytes=self.heal_received_bytes,
            )
        self.log(event)
        return self.healed_state

    def size(self) -> int:
        """The replicas in the current quorum: those an exchange averages over."""
        return self.manager.num_participants()

    def all_reduce_sum(self, flat: torch.Tensor) -> Any:
        """Start summing `flat` in place over the quorum (torchft's allreduce: an error is recorded, not raised,
        and makes `commit()` refuse); a torch Work."""
        from torch.distributed import ReduceOp

        return self.manager.allreduce(flat, reduce_op=ReduceOp.SUM)

    def all_gather(self, gathered: list[torch.Tensor], payload: torch.Tensor) -> Any:
        """Start gathering every replica's `payload` into `gathered` (one tensor per replica in the quorum, in its
        order), as all_reduce_sum does: an error is recorded in the Manager, not raised, and makes `commit()`
        refuse; a future to wait on, or None where the round has already failed (nothing is sent)."""
        from torch.distributed.distributed_c10d import AllgatherOptions

        if self.manager.errored():
            return None
        try:
            work = self._pg.allgather([gathered], [payload], AllgatherOptions())
        except Exception as error:  # a peer already gone: the round is discarded, as torchft does for allreduce
            self.manager.report_error(error)
            return None
        return self.manager.wrap_future(work.get_future(), gathered)

    def commit(self) -> bool:
        """Whether every replica in the quorum completed this round's exchange (torchft's should_commit); False:
        discard the round."""
        return self.manager.should_commit()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
