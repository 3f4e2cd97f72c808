#!/usr/bin/env bash
# Validates `harness project` (results/reference/projection-validation): predicted vs measured tokens/s for the four
# methods on three profiles (100 Mbit/s at RTT 0, 40, 160 ms) and two models. Measured: tiny from the latency study
# (scripts/wan-latency-study.sh, run it first), small from the sweep below (n=1: what 2 cores had time for).
# Compute comes from other runs than the predicted ones: the same settings on an unshaped link.
# Run from a clean checkout (git_dirty: false); rerunning resumes. Usage: scripts/projection-validation.sh [OUT_ROOT]
set -euo pipefail
out=${1:-results/reference}
v="$out/projection-validation"
methods=allreduce,opendiloco,cocktail,dilocox
harness sweep --methods $methods --profiles unshaped --seeds 0,1,2 --model tiny --steps 60 --eval-every 30 \
    --set local_steps=10 --out "$v/compute-tiny"
harness sweep --methods $methods --profiles unshaped --seeds 0 --model small --steps 30 --eval-every 30 \
    --set local_steps=10 --out "$v/compute-small"
harness sweep --methods $methods --profiles 100mbps,wan-100mbps-40ms-rtt,wan-100mbps-160ms-rtt \
    --link-emulator userspace --seeds 0 --model small --steps 30 --eval-every 30 --set local_steps=10 --out "$v/small"
harness project --validate "$out/wan-latency-tiny" --validate "$v/small" \
    --compute-from "$v/compute-tiny" --compute-from "$v/compute-small" --csv "$v/validation.csv" >"$v/validation.md"
