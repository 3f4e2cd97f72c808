#!/usr/bin/env bash
# Goodput under random failures (results/reference/goodput-tiny): AllReduce (FT-DDP, 200 steps), OpenDiLoCo (H = 20,
# 2,000 steps: about the same wall time) and DiLoCoX (its defaults, 2,000 steps) under `--set fault_tolerance=torchft`
# on 100 Mbit/s, with no failures and with each replica failing after exponential up times of mean 120 s and 40 s
# (restarted 2 s later, healed from its peer across the link), 3 seeds each (the failure times differ by seed).
# replica_timeout_s=10: a survivor whose dead peer's connection stays open gives up on the exchange after 10 s
# instead of 60. The failure rates, the timeout and the step counts were chosen on seeds 0-2 (goodput-tiny,
# in-sample), OpenDiLoCo's H and DiLoCoX's defaults on seeds 0-5 (sweep.json's selected_on says so); a study on
# seeds none of that saw is out-of-sample: scripts/goodput-study.sh results/reference 10,11,12 goodput-tiny-heldout.
# Run from a clean checkout (git_dirty: false); rerunning resumes.
# Usage: scripts/goodput-study.sh [OUT_ROOT [SEEDS [NAME]]]   (defaults: results/reference 0,1,2 goodput-tiny)
set -euo pipefail
out=${1:-results/reference}/${3:-goodput-tiny}
common=(--profiles 100mbps --seeds ${2:-0,1,2} --model tiny --batch-size 2 --seq-len 64 --set fault_tolerance=torchft
    --set replica_timeout_s=10 --set mtbf_s=none,120,40)
harness sweep --methods allreduce --steps 200 "${common[@]}" --selected-on allreduce=0,1,2 --out "$out/allreduce"
harness sweep --methods opendiloco --steps 2000 --set local_steps=20 "${common[@]}" \
    --selected-on opendiloco=0,1,2,3,4,5 --out "$out/opendiloco"
harness sweep --methods dilocox --steps 2000 "${common[@]}" --selected-on dilocox=0,1,2,3,4,5 --out "$out/dilocox"
harness report "$out" --csv "$out/comparison.csv" >"$out/report.md"
harness plot "$out" --out "$out/figures"
