#!/usr/bin/env bash
# What round-trip time does to each method (results/reference/wan-latency-tiny): one rate (100 Mbit/s) at RTT 0, 40
# and 160 ms. Every run goes through the userspace delay line (--link-emulator userspace, also at RTT 0), so the
# runs differ only in the delay. Run from a clean checkout (git_dirty: false); rerunning resumes.
# Usage: scripts/wan-latency-study.sh [OUT_ROOT]
set -euo pipefail
out=${1:-results/reference}
harness sweep --methods allreduce,opendiloco,cocktail,dilocox \
    --profiles 100mbps,wan-100mbps-40ms-rtt,wan-100mbps-160ms-rtt --link-emulator userspace \
    --seeds 0,1,2 --model tiny --steps 60 --eval-every 30 --set local_steps=10 --out "$out/wan-latency-tiny"
harness report "$out/wan-latency-tiny" --csv "$out/wan-latency-tiny/comparison.csv" >"$out/wan-latency-tiny/report.md"
harness plot "$out/wan-latency-tiny" --out "$out/wan-latency-tiny/figures"
