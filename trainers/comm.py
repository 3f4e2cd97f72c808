"""Collectives with their wire accounting and timing, shared by the methods.

Payload accounting follows the algorithm gloo and NCCL run for n ranks: a ring all-reduce sends 2(n-1)/n of the
buffer from every rank; a ring all-gather sends (n-1) chunks from every rank. Summed over ranks this is what should
appear on the links' kernel counters (plus TCP/IP headers), which is how the harness checks the method's word.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from trainers.compression.quantize import Quantized, dequantize, quantize, quantized_nbytes
from trainers.fault_tolerance import ManagedGroup


def allreduce_payload_bytes(nbytes: int, n: int) -> int:
    return 0 if n <= 1 else round(2 * (n - 1) / n * nbytes)


def allgather_payload_bytes(nbytes_per_rank: int, n: int) -> int:
    return (n - 1) * nbytes_per_rank


class InFlight:
    """An asynchronous collective whose duration and the caller's blocked time are measured.

    The completion time comes from the future's callback, which the communication thread runs when the collective
    finishes, so the share of its duration that overlapped computation is known, not guessed.
    """

    def __init__(self, work: dist.Work | None, payload_bytes: int, done_when_waited: bool = False):
        """`done_when_waited`: the work's future runs no callback (torchft's, when a replica failed in it), so the
        collective counts as done when `wait()` returns: right for an exchange the caller blocks on at once."""
        self.payload_bytes = payload_bytes
        self.started = time.perf_counter()
        self._done_at: float | None = None
        self._done = threading.Event()
        self._work = work
        self._done_when_waited = done_when_waited
        if work is None:
            self._done_at = self.started
            self._done.set()
        elif not done_when_waited:
            work.get_future().then(self._mark_done)

    def _mark_done(self, fut: torch.futures.Future | None) -> None:
        self._done_at = time.perf_counter()
        self._done.set()

    def wait(self) -> tuple[float, float]:
        """Block until done; returns (blocked_s, overlapped_s)."""
        wait_from = time.perf_counter()
        if self._work is not None:
            self._work.wait()
        if self._done_when_waited and not self._done.is_set():
            self._mark_done(None)
        self._done.wait()
        blocked = time.perf_counter() - wait_from
        duration = max(0.0, self._done_at - self.started)
        return blocked, max(0.0, duration - blocked)


class InThread:
    """An exchange of several dependent collectives (one's result shapes the next), run on a thread of its own so
    that it overlaps computation as one collective does; InFlight's interface.

    `run()` does the collectives and whatever sits between them and returns what the exchange produced, which
    `result` holds once `wait()` returns; an error raised inside it is raised again by `wait()`. `wait()` may be
    called more than once (a method can need the exchange's side effects before it needs its result): each call
    adds the time it blocked, and each returns the total so far, so the last one reports the exchange in full.
    """

    def __init__(self, run: Callable[[], Any], payload_bytes: int):
        self.payload_bytes = payload_bytes
        self.result: Any = None
        self.started = time.perf_counter()
        self._done_at = self.started
        self._blocked_s = 0.0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(run,), daemon=True)
        self._thread.start()

    def _run(self, run: Callable[[], Any]) -> None:
        try:
            self.result = run()
        except BaseException as error:  # re-raised on the caller's thread by wait()
            self._error = error
        self._done_at = time.perf_counter()

    def wait(self) -> tuple[float, float]:
        """Block until done; returns (blocked_s over every call, overlapped_s)."""
        wait_from = time.perf_counter()
        self._thread.join()
        self._blocked_s += time.perf_counter() - wait_from
        if self._error is not None:
            raise self._error
        duration = max(0.0, self._done_at - self.started)
        return self._blocked_s, max(0.0, duration - self._blocked_s)


def all_reduce_sum(flat: torch.Tensor, group: dist.ProcessGroup | ManagedGroup | None) -> InFlight:
    """Start summing `flat` in place across `group`; the sum is there once `wait()` returns."""
    if group is None:
        return InFlight(None, 0)
    nbytes = flat.numel() * flat.element_size()
    if isinstance(group, ManagedGroup):
        # Under fault tolerance: over the replicas in the quorum, through torchft (trainers/fault_tolerance.py).
        return InFlight(group.all_reduce_sum(flat), allreduce_payload_bytes(nbytes, group.size()), True)
    work = dist.all_reduce(flat, group=group, async_op=True)
    return InFlight(work, allreduce_payload_bytes(nbytes, dist.get_world_size(group)))


def all_gather_bytes(payload: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[list[torch.Tensor], InFlight]:
    """Start gathering every rank's uint8 `payload` (equal sizes on all ranks), so each rank can decode them all.

    The returned list is filled once `wait()` returns.
    """
    if group is None:
        return [payload], InFlight(None, 0)
    if isinstance(group, ManagedGroup):
        # Zeros, not empty: a gather that failed leaves them as they were, and the round, discarded, still decodes
        # them to finite numbers (a zero scale decodes to zero).
        gathered = [torch.zeros_like(payload) for _ in range(group.size())]
        work = group.all_gather(gathered, payload)
        return gathered, InFlight(work, allgather_payload_bytes(payload.numel(), len(gathered)), True)
    gathered = [torch.empty_like(payload) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(gathered, payload, group=group, async_op=True)
    return gathered, InFlight(work, allgather_payload_bytes(payload.numel(), dist.get_world_size(group)))


def ring_chunk_numel(numel: int, n: int, bucket_size: int) -> int:
    """Elements per chunk of `quantized_ring_sum`: a 1/n share rounded up to whole quantization buckets."""
    return -(-numel // (n * bucket_size)) * bucket_size


def quantized_ring_payload_bytes(numel: int, n: int, bits: int, bucket_size: int = 128) -> int:
    """What each rank sends in `quantized_ring_sum`: n - 1 quantized chunks around the ring, n - 1 in the gather."""
    if n <= 1:
        return 0
    return 2 * (n - 1) * quantized_nbytes(ring_chunk_numel(numel, n, bucket_size), bits, bucket_size)


def quantized_ring_sum(
    flat: torch.Tensor, group: dist.ProcessGroup | None, bits: int, bucket_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of fp32 `flat` over `group`, each hop's partial sum sent as `bits`-bit codes with per-bucket scales,
    and this rank's rounding: what its own quantizations took off the values it sent, where they sit in `flat`.

    gloo sums what it is given, so a quantized payload cannot ride its all-reduce; this is the ring by hand: a
    reduce-scatter in n - 1 steps, each rank sending one chunk's running sum to the next and adding the chunk it
    receives (decoded) to its own, then an all-gather of each rank's finished chunk, quantized once more. Every rank
    decodes the same gathered bytes, so the sum is the same everywhere; it carries n quantization errors, one per
    hop, each made by the rank that sent it. So the roundings of all ranks add up to the exact sum minus the
    returned one, and a caller's error feedback can keep them. Blocking (run it on a thread: InThread). With no
    group the input comes back as it is: nothing travels, nothing rounds.
    """
    if group is None:
        return flat, torch.zeros_like(flat)
    n, me = dist.get_world_size(group), dist.get_rank(group)
    numel = flat.numel()
    chunk = ring_chunk_numel(numel, n, bucket_size)
    chunks = list(torch.nn.functional.pad(flat.float(), (0, n * chunk - numel)).view(n, chunk).clone())
    rounding = torch.zeros(n, chunk)
    nbytes = quantized_nbytes(chunk, bits, bucket_size)

    def decode(buf: torch.Tensor) -> torch.Tensor:
        return dequantize(Quantized.from_bytes(buf, chunk, bits, bucket_size), (chunk,))

    def send_as_codes(index: int) -> torch.Tensor:
        codes = quantize(chunks[index], bits, bucket_size)
        rounding[index] += chunks[index] - dequantize(codes, (chunk,))
        return codes.to_bytes()

    for k in range(n - 1):
        sent, received = (me - k) % n, (me - k - 1) % n
        inbox = torch.empty(nbytes, dtype=torch.uint8)
        ops = [
            dist.P2POp(dist.isend, send_as_codes(sent), group=group, group_peer=(me + 1) % n),
            dist.P2POp(dist.irecv, inbox, group=group, group_peer=(me - 1) % n),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        chunks[received] = chunks[received] + decode(inbox)
    # Rank r now holds the whole sum of chunk (r + 1) mod n.
    gathered = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(n)]
    dist.all_gather(gathered, send_as_codes((me + 1) % n), group=group)
    total = torch.empty(n, chunk)
    for rank, buf in enumerate(gathered):
        total[(rank + 1) % n] = decode(buf)
    return total.view(-1)[:numel], rounding.view(-1)[:numel]


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
