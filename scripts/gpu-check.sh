#!/usr/bin/env bash
# One short GPU check of the netns backend (CUDA tensors; NCCL, then gloo) on a machine with an NVIDIA GPU.
# Usage, as root from the repository root with torch and pyroute2 importable: scripts/gpu-check.sh REPORT_FILE
set -uo pipefail
report=${1:?usage: scripts/gpu-check.sh REPORT_FILE}
work=$(mktemp -d)
export PYTHONUNBUFFERED=1
h() { timeout 150 python3 -m harness.cli "$@"; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
  h doctor
  # NCCL over the shaped veth, both ranks on the one GPU (NCCL may refuse two ranks per device: recorded either way).
  echo "== calibrate, NCCL"; h calibrate --profile 1gbps --out "$work/cal-nccl" 2>&1 | tail -4
  echo "== allreduce, small, NCCL"
  h run --profile 1gbps --method allreduce --model small --steps 30 --eval-every 10 --out "$work/ar-nccl" 2>&1 | tail -9
  grep -ihE "nccl (warn|info).*(net/socket|duplicate)|error" "$work"/ar-nccl/logs/rank0.log 2>/dev/null | head -5
  # CUDA tensors over gloo, and DiLoCoX, so the device path is exercised even where NCCL refuses.
  echo "== allreduce, small, CUDA tensors over gloo"
  HARNESS_DIST_BACKEND=gloo h run --profile 1gbps --method allreduce --model small --steps 30 --eval-every 10 \
    --out "$work/ar-gloo" 2>&1 | tail -9
  echo "== dilocox, small, CUDA tensors over gloo"
  HARNESS_DIST_BACKEND=gloo h run --profile 1gbps --method dilocox --model small --steps 60 --set local_steps=10 \
    --eval-every 20 --out "$work/dx-gloo" 2>&1 | tail -9
  for d in cal-nccl ar-nccl ar-gloo dx-gloo; do
    echo "== $d summary"; cat "$work/$d/summary.json" 2>/dev/null
  done
  echo "== namespaces left: $(ip netns list | wc -l)"
} > "$report" 2>&1
