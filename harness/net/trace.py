"""Replayed links: a profile's ``trace: FILE``, the inter_cluster link's rate and/or one-way delay over time.

The file is CSV (``#`` starts a comment line, blank lines are skipped) whose header names its columns: ``seconds``
and at least one of ``rate`` and ``delay``, in any order:

    seconds,rate,delay
    0,50mbit,20ms
    2.5,12mbit,45ms

- ``seconds``: from the moment training starts (harness/run/linktrace.py records it), the first row at 0, each row
  at least MIN_ROW_S after the one before. A row holds until the next; after the last row the link keeps it (the
  trace does not loop: write it as long as the run, repeating rows for a longer run).
- ``rate``: tc units (``100mbit``) or plain bits/s; every row is held to what a profile's rate is (tbf's fields,
  with the link's queue; the machine's shapeable ceiling).
- ``delay``: one-way, as a profile's ``delay``; replayed by the userspace delay line, each hop taking half.

FILE is relative to the profile file, or absolute. The trace's first row is the link's rate and delay before and
at the start of training (the link check measures it), so a profile that also sets the column's key on
inter_cluster is refused, as is a trace on a profile with ``sites`` (the replay re-rates every site's link alike).
Everything is refused here, as a ProfileError naming the fix, before anything is created.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import re
from pathlib import Path

from harness.net.link import LinkSpec, ProfileError, parse_rate_bps, parse_time_ms
from harness.net.tracepoints import LinkTrace, TracePoint

COLUMNS = ("seconds", "rate", "delay")
# The replay changes the link at most this often: a rate change costs ~40 ms of netlink calls on two clusters, and
# the measurement samples every 100 ms.
MIN_ROW_S = 0.1
# Each row becomes ~20 characters of the delay line's command line, which Linux caps at 128 KiB per argument.
MAX_ROWS = 3600


def load_trace(path: Path, where: str) -> LinkTrace:
    """The trace in `path` (already resolved against the profile's folder); `where` names the profile's key."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ProfileError(
            f"{where}: trace file {path} does not exist; write its path relative to the profile file, or an absolute "
            "one"
        ) from None
    except IsADirectoryError:
        raise ProfileError(f"{where}: trace {path} is a folder; name a CSV file (seconds,rate,delay)") from None
    except UnicodeDecodeError:
        raise ProfileError(
            f"{where}: trace file {path} is not UTF-8 text; write it as CSV (seconds,rate,delay)"
        ) from None
    except OSError as err:
        raise ProfileError(f"{where}: trace file {path} cannot be read ({err.strerror}); make it readable") from None
    return parse_trace(text, str(path))


def parse_trace(text: str, source: str) -> LinkTrace:
    """The trace CSV `text` (module doc) as a LinkTrace; `source` names the file in refusals."""
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), start=1)]
    lines = [(n, line) for n, line in lines if line and not line.startswith("#")]
    if not lines:
        raise ProfileError(f"trace {source} is empty; write a header (seconds,rate,delay) and at least one row")
    header = _header(lines[0][1], source)
    rows = lines[1:]
    if not rows:
        raise ProfileError(f"trace {source} has a header but no rows; add at least one row, e.g. 0,50mbit")
    if len(rows) > MAX_ROWS:
        raise ProfileError(f"trace {source} has {len(rows):,} rows, more than {MAX_ROWS:,}; use fewer, longer rows")
    points: list[TracePoint] = []
    for number, line in rows:
        point = _row(line, header, f"trace {source} line {number}")
        if points:
            _check_order(points[-1].seconds, point.seconds, f"trace {source} line {number}")
        elif point.seconds != 0:
            raise ProfileError(f"trace {source} line {number}: the first row is at {point.seconds:g} s; start at 0")
        points.append(point)
    return LinkTrace(source, tuple(points))


def _header(line: str, source: str) -> tuple[str, ...]:
    names = tuple(name.strip().lower() for name in line.split(","))
    unknown = sorted(set(names) - set(COLUMNS))
    if unknown or len(set(names)) != len(names) or "seconds" not in names or len(names) < 2:
        raise ProfileError(
            f"trace {source}: header {line!r} must name seconds and rate and/or delay, each once (e.g. "
            "seconds,rate,delay)" + (f"; unknown: {', '.join(unknown)}" if unknown else "")
        )
    return names


def _row(line: str, header: tuple[str, ...], where: str) -> TracePoint:
    values = [value.strip() for value in line.split(",")]
    if len(values) != len(header) or not all(values):
        raise ProfileError(
            f"{where}: {line!r} is not understood; write {len(header)} values ({','.join(header)}), none empty"
        )
    cells = dict(zip(header, values, strict=True))
    try:
        seconds = float(cells["seconds"])
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise ProfileError(f"{where}: seconds {cells['seconds']!r} must be a number of seconds from 0, e.g. 2.5")
    try:
        return TracePoint(
            seconds,
            rate_bps=_rate_bps(cells["rate"]) if "rate" in cells else None,
            delay_ms=parse_time_ms(cells["delay"], "delay") if "delay" in cells else None,
        )
    except ProfileError as err:
        raise ProfileError(f"{where}: {err}") from None


def _rate_bps(text: str) -> int:
    number = re.fullmatch(r"(-?)\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)", text.lower())
    if number and (number.group(1) or float(number.group(2)) == 0):
        raise ProfileError(f"rate {text!r} must be positive; write a rate above 0, e.g. 50mbit")
    # Plain bits/s, as the column allows; tc's units otherwise.
    return parse_rate_bps(f"{text}bit" if number and not number.group(3) else text)


def _check_order(before_s: float, seconds: float, where: str) -> None:
    if seconds <= before_s:
        raise ProfileError(
            f"{where}: {seconds:g} s does not come after the row before it ({before_s:g} s); sort the rows by time, "
            "each time once"
        )
    if seconds - before_s < MIN_ROW_S - 1e-9:
        raise ProfileError(
            f"{where}: {seconds:g} s is {seconds - before_s:.3g} s after the row before it; rows must be at least "
            f"{MIN_ROW_S:g} s apart (the replay changes the link at most {1 / MIN_ROW_S:g} times a second)"
        )


def replays_rate(trace: LinkTrace) -> bool:
    return trace.points[0].rate_bps is not None


def replays_delay(trace: LinkTrace) -> bool:
    return trace.points[0].delay_ms is not None


def with_first_row(link_yaml: object, trace: LinkTrace, where: str) -> object:
    """The profile's inter_cluster mapping with the trace's first row in it: the link as training starts, to be
    parsed as any profile's (a key the trace's columns set is refused there; what is not a mapping, left to the
    parser to refuse)."""
    if link_yaml is not None and not isinstance(link_yaml, dict):
        return link_yaml
    link = dict(link_yaml or {})
    first = trace.points[0]
    for key, value in (("rate", first.rate_bps), ("delay", first.delay_ms)):
        if value is not None and key in link:
            raise ProfileError(
                f"{where} sets inter_cluster {key} and its trace has a {key} column; remove one (the trace's first "
                f"row is the {key} at the start)"
            )
    if first.rate_bps is not None:
        link["rate"] = f"{first.rate_bps}bit"
    if first.delay_ms is not None:
        link["delay"] = f"{first.delay_ms!r}ms"
    return link


def check_rows(start: LinkSpec, trace: LinkTrace, where: str) -> None:
    """Every row after the first, as the link the replay makes of `start` (the link at the first row): a new rate on
    it, its burst re-derived (harness/backends/netns.py set_link_rate), and a new delay on it in the delay line."""
    for number, point in enumerate(trace.points[1:], start=2):
        if point.rate_bps is not None:
            _row_link(start, {"rate_bps": point.rate_bps, "burst_bytes": None}, point, number, where)
        if point.delay_ms is not None:
            _row_link(start, {"delay_ms": point.delay_ms}, point, number, where)


def _row_link(link: LinkSpec, changes: dict, point: TracePoint, number: int, where: str) -> None:
    row = f"{where}: row {number} (at {point.seconds:g} s)"
    try:
        made = dataclasses.replace(link, **changes)
    except ProfileError as err:
        raise ProfileError(f"{row}: {err}") from None
    made.check(row)


def max_rate_bps(trace: LinkTrace) -> int | None:
    rates = [p.rate_bps for p in trace.points if p.rate_bps is not None]
    return max(rates) if rates else None


def rate_bps_at(trace: LinkTrace, seconds: float, default_bps: int | None) -> int | None:
    """The trace's rate `seconds` after the start (its first row before it); `default_bps` without a rate column."""
    if not replays_rate(trace):
        return default_bps
    return trace.points[_row_at(trace, seconds)].rate_bps


def delay_ms_at(trace: LinkTrace, seconds: float) -> float | None:
    return trace.points[_row_at(trace, seconds)].delay_ms


def _row_at(trace: LinkTrace, seconds: float) -> int:
    return max(0, bisect.bisect_right([p.seconds for p in trace.points], seconds) - 1)


def mean_rate_bps(trace: LinkTrace, start_s: float, end_s: float, default_bps: int | None) -> float | None:
    """The trace's rate averaged over [start_s, end_s], each row weighted by its time in it; `default_bps` without
    a rate column."""
    if not replays_rate(trace):
        return default_bps
    if end_s <= start_s:
        return rate_bps_at(trace, start_s, None)
    edges = [start_s, *(p.seconds for p in trace.points if start_s < p.seconds < end_s), end_s]
    bits = sum(rate_bps_at(trace, a, None) * (b - a) for a, b in itertools.pairwise(edges))
    return bits / (end_s - start_s)


def hop_delay_schedule(trace: LinkTrace) -> str:
    """The delay line's --delay-trace: "seconds:ms,..." of one hop (half the one-way delay), a row where it changes."""
    rows, last = [], None
    for point in trace.points:
        if point.delay_ms != last:
            rows.append(f"{point.seconds!r}:{point.delay_ms / 2!r}")
            last = point.delay_ms
    return ",".join(rows)
