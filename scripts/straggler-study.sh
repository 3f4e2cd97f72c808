#!/usr/bin/env bash
# What one slow site does to each method (results/reference/straggler-tiny): 4 sites, every one on 1 Gbit/s, against
# the same 4 sites with site 3 on 100 Mbit/s (straggler-1gbps-one-site-100mbps). summary.json's per_cluster holds
# each site's wire bytes and the time its replica waited on the link; the report and figure show both.
# Run from a clean checkout (git_dirty: false); rerunning resumes. Usage: scripts/straggler-study.sh [OUT_ROOT]
set -euo pipefail
out=${1:-results/reference}
harness sweep --methods allreduce,opendiloco,cocktail,dilocox \
    --profiles 1gbps,straggler-1gbps-one-site-100mbps --clusters 4 \
    --seeds 0,1,2 --model tiny --steps 60 --eval-every 30 --set local_steps=10 --out "$out/straggler-tiny"
harness report "$out/straggler-tiny" --csv "$out/straggler-tiny/comparison.csv" >"$out/straggler-tiny/report.md"
harness plot "$out/straggler-tiny" --out "$out/straggler-tiny/figures"
