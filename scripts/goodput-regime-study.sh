#!/usr/bin/env bash
# Goodput under random failures on the regime-matched link (results/reference/goodput-regime-tiny): where a heal is
# slow. The link is derived once when the study starts (harness regime: AllReduce as communication-bound as the
# paper's 107B run, R = 357.5; about 4.6 Mbit/s for tiny on this 2-core host), so a heal moves the replica's whole
# state over it: ~10.6 MB for AllReduce, 17.6 MB for OpenDiLoCo, 29 MB for DiLoCoX (18, 30 and 50 s at 4.6 Mbit/s).
# Each method runs about 5 minutes without failures (AllReduce 50 steps at ~6.4 s a step, OpenDiLoCo (H = 20) 1,500
# steps, DiLoCoX 2,000 steps, which takes less), under `--set fault_tolerance=torchft` with no failures and with each
# replica failing after exponential up times of mean 600 s and 200 s (restarted 2 s later), 3 seeds each.
# replica_timeout_s=120: an exchange or a heal may take a minute on this link before it counts as failed.
# Seeds 10-12: the failure rates and step counts were set from the link model, not on any seed's runs; OpenDiLoCo's H
# and DiLoCoX's defaults were chosen on seeds 0-5 (sweep.json's selected_on), so every row is out of sample.
# Run from a clean checkout (git_dirty: false); rerunning resumes. Usage: scripts/goodput-regime-study.sh [OUT_ROOT]
set -euo pipefail
out=${1:-results/reference}/goodput-regime-tiny
shape=(--model tiny --batch-size 2 --seq-len 64)
if [[ ! -f "$out/profiles/paper-107b.yaml" ]]; then
    mkdir -p "$out/profiles"
    harness regime --target paper-107b "${shape[@]}" --out "$out/profiles/paper-107b.yaml"
fi
common=(--profiles "$out/profiles/paper-107b.yaml" --seeds 10,11,12 "${shape[@]}" --set fault_tolerance=torchft
    --set replica_timeout_s=120 --set mtbf_s=none,600,200)
harness sweep --methods allreduce --steps 50 --eval-every 10 "${common[@]}" --out "$out/allreduce"
harness sweep --methods opendiloco --steps 1500 --set local_steps=20 "${common[@]}" \
    --selected-on opendiloco=0,1,2,3,4,5 --out "$out/opendiloco"
harness sweep --methods dilocox --steps 2000 "${common[@]}" --selected-on dilocox=0,1,2,3,4,5 --out "$out/dilocox"
harness report "$out" --csv "$out/comparison.csv" >"$out/report.md"
harness plot "$out" --out "$out/figures"
