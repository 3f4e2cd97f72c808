"""Did the link keep its rate? A token-bucket conformance check on the wire counters a run samples every step.

A link shaped to rate R with a bucket of B bytes can carry, in any window of w seconds, at most R w / 8 + B bytes.
Each cluster's stage-0 rank reads its uplink's transmit counter (after the qdisc) at the end of every step, so every
pair of samples is such a window. The worst window's excess is

    link_max_excess = max over clusters and sample pairs i < j of  (bytes_j - bytes_i) / (R (t_j - t_i) / 8 + B_ref)

where B_ref is the rate-true burst for R (`harness.net.link.default_burst_bytes`: a few milliseconds of line
time), not the profile's own burst: a profile whose burst is larger lets a payload run ahead of the rate (256 KiB
at 4 Mbit/s is half a second of line time), which is exactly what this check exists to flag. A value <= 1.02
conforms (2% for the counters' framing and the sampling's timing); a larger one means the link was not the
bottleneck it claims to be, and the report marks the run.
"""

from __future__ import annotations

import numpy as np

CONFORMANCE_TOLERANCE = 1.02


def max_excess(samples: list[tuple[float, int]], rate_bps: float, burst_bytes: float) -> float | None:
    """The worst window's bytes over what a rate_bps link with a burst_bytes bucket allows (module doc); None
    with fewer than two samples. `samples` are (time in seconds, cumulative bytes) in time order."""
    if len(samples) < 2:
        return None
    t = np.array([s[0] for s in samples], dtype=np.float64)
    sent = np.array([s[1] for s in samples], dtype=np.float64)
    worst = 0.0
    for lag in range(1, len(samples)):
        allowed = rate_bps / 8 * (t[lag:] - t[:-lag]) + burst_bytes
        worst = max(worst, float(np.max((sent[lag:] - sent[:-lag]) / allowed)))
    return worst


def conforms(excess: float | None) -> bool | None:
    return None if excess is None else excess <= CONFORMANCE_TOLERANCE
