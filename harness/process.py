"""Process lifetimes: a process that must not outlive its parent asks the kernel to signal it when the parent dies."""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: signal.Signals) -> None:
    """The kernel sends `sig` to this process when its parent dies, even by SIGKILL. Callers check getppid()
    afterwards: a parent that died before this call is not covered."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
