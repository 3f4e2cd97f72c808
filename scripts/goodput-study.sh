#!/usr/bin/env bash
# Goodput under random failures (results/reference/goodput-tiny): AllReduce (FT-DDP, 200 steps) and OpenDiLoCo (H = 20,
# 2,000 steps: about the same wall time) under `--set fault_tolerance=torchft` on 100 Mbit/s, with no failures and
# with each replica failing after exponential up times of mean 120 s and 40 s (restarted 2 s later, healed from its
# peer across the link), 3 seeds each (the failure times differ by seed). replica_timeout_s=10: a survivor whose dead
# peer's connection stays open gives up on the exchange after 10 s instead of 60.
# Run from a clean checkout (git_dirty: false); rerunning resumes. Usage: scripts/goodput-study.sh [OUT_ROOT]
set -euo pipefail
out=${1:-results/reference}/goodput-tiny
common=(--profiles 100mbps --seeds 0,1,2 --model tiny --batch-size 2 --seq-len 64 --set fault_tolerance=torchft
    --set replica_timeout_s=10 --set mtbf_s=none,120,40)
harness sweep --methods allreduce --steps 200 "${common[@]}" --out "$out/allreduce"
harness sweep --methods opendiloco --steps 2000 --set local_steps=20 "${common[@]}" --out "$out/opendiloco"
harness report "$out" --csv "$out/comparison.csv" >"$out/report.md"
harness plot "$out" --out "$out/figures"
