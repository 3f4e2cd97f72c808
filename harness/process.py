"""Process lifetimes: a process that must not outlive its parent asks the kernel to signal it when the parent dies;
work that native code would keep from answering Ctrl-C runs in a child that can be killed."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: signal.Signals) -> None:
    """The kernel sends `sig` to this process when its parent dies, even by SIGKILL. Callers check getppid()
    afterwards: a parent that died before this call is not covered."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def stop_process(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM a child that is still running, SIGKILL it if it has not exited after `grace_s`; reap it either way."""
    if process.poll() is None:
        process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run_interruptibly(work: Callable[[], Any]) -> Any:
    """work() in a forked child, its result or exception passed back: for native code that holds the GIL for
    minutes (the tokenizers library's training), where a signal's Python handler would wait until it returns.
    SIGINT or SIGTERM kills the child at once; the signal then goes on to the handler that was in place before
    (a Ctrl-C reaches the child too, as it is in the terminal's process group) and KeyboardInterrupt is raised."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(work, send), daemon=True)
    received: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        received.append(signum)
        child.kill()

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, stop) for sig in _STOP_SIGNALS} if in_main_thread else {}
    try:
        child.start()
        send.close()
        try:
            ok, value = receive.recv()
        except EOFError:
            ok, value = False, None
        child.join()
    finally:
        receive.close()
        child.kill()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received or child.exitcode in (-signal.SIGINT, -signal.SIGTERM):
        for signum in received:
            os.kill(os.getpid(), signum)
        raise KeyboardInterrupt
    if value is None and not ok:
        raise RuntimeError(f"the child process doing the work ended with exit code {child.exitcode}")
    if not ok:
        raise value
    return value


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _child(work: Callable[[], Any], send: Connection) -> None:
    set_parent_death_signal(signal.SIGKILL)
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    try:
        send.send((True, work()))
    except Exception as err:
        send.send((False, err))
    finally:
        send.close()
