#!/usr/bin/env python3
"""The CI gate's self-test: `harness check` must pass on this code and fail, naming the method and the metric, on
each regression injected below (code patched in a scratch copy of the checkout, never in the checkout itself).

    .venv/bin/python scripts/gate-selftest.py [--baseline FILE] [--results DIR] [--out DIR] [--only NAME ...]
                                              [--taskset CPUS] [--hog]

1. The clean check: `harness check --baseline FILE` on this checkout (or the runs of --results DIR, made by such a
   check), which must pass. --taskset CPUS runs it under `taskset -c CPUS` (e.g. 0: half of a 2-core machine's
   compute), --hog beside a process that spins on one CPU for as long as it runs: the gate must still pass.
2. Each injection: the checkout's code (without results/, docs/ and tests/) copied into OUT/NAME/code, one anchor
   replaced, the injected method's runs remade there with the baseline's settings (the `harness sweep` the baseline
   names, run by this Python with PYTHONPATH at the copy), and `harness check --results` over those runs beside the
   clean check's runs of every other method. It must exit 1 with the expected metric of the injected method outside
   its band.

Exit 0 when the clean check passes and every injection is caught; 1 otherwise, with the table of what happened.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.analysis.experiments.reference_code import CODE_PATHS  # noqa: E402
from harness.analysis.gate.bands import REFERENCE_CODE_FOLDER, load_baseline, sweep_command  # noqa: E402

# Sleeps 15% of the step's own time since the previous call (the sleeps themselves left out, so the slowdown does
# not compound): the step of the method, 15% slower on any machine.
SLOWER_STEP = """    def step(self, step: int) -> SyncReport | None:
        import time as _selftest_time

        _now = _selftest_time.perf_counter()
        _last = getattr(self, "_selftest_last", None)
        if _last is not None:
            _pause = 0.15 * (_now - _last[0] - _last[1])
            _selftest_time.sleep(_pause)
            self._selftest_last = (_now, _pause)
        else:
            self._selftest_last = (_now, 0.0)
"""


@dataclass(frozen=True)
class Edit:
    path: str  # the file patched, relative to the checkout
    anchor: str  # the text replaced; it must occur exactly once
    replacement: str


@dataclass(frozen=True)
class Injection:
    name: str
    method: str  # whose runs are remade with the patched code
    metric: str  # the metric of `method` that must fall outside its band
    edits: tuple[Edit, ...]
    what: str


INJECTIONS = (
    Injection(
        "dilocox-step-15pct-slower", "dilocox", "step_overhead",
        (Edit("trainers/methods/dilocox.py", "    def step(self, step: int) -> SyncReport | None:\n", SLOWER_STEP),),
        "DiLoCoX's step sleeps 15% of its own time",
    ),
    Injection(
        "dilocox-overlap-lost", "dilocox", "step_time_residual",
        (Edit("trainers/methods/dilocox.py", "            self.sending = self._send()\n", "            pass\n"),),
        "streaming no longer starts the exchange tau steps early: it is sent at the round's end and waited for",
    ),
    Injection(
        "dilocox-2pct-more-bytes", "dilocox", "payload_bytes_per_token",
        (
            Edit(
                "trainers/comm.py",
                "    gathered = [torch.empty_like(payload) for _ in range(dist.get_world_size(group))]\n",
                "    payload = torch.cat([payload, payload.new_zeros(payload.numel() // 50)])\n"
                "    gathered = [torch.empty_like(payload) for _ in range(dist.get_world_size(group))]\n",
            ),
            Edit(
                "trainers/compression/compressors.py",
                "    sizes = [compressor.payload_nbytes(shape) for shape in shapes]\n",
                "    sizes = [compressor.payload_nbytes(shape) for shape in shapes]\n"
                "    gathered = [buffer[: sum(sizes)] for buffer in gathered]\n",
            ),
        ),
        "every all-gathered payload (DiLoCoX's exchange) carries 2% more bytes, dropped on arrival",
    ),
    Injection(
        "dilocox-loss-0.5pct-higher", "dilocox", "final_val_loss",
        (
            Edit(
                "trainers/train.py",
                "            self.val_loss = self.setup.stage.evaluate(self.setup.val_batches)\n",
                "            self.val_loss = 1.005 * self.setup.stage.evaluate(self.setup.val_batches)\n",
            ),
        ),
        "the validation loss comes out 0.5% higher",
    ),
    Injection(
        "demo-step-15pct-slower", "demo", "step_overhead",
        (Edit("trainers/methods/demo.py", "    def step(self, step: int) -> SyncReport | None:\n", SLOWER_STEP),),
        "DeMo's step sleeps 15% of its own time",
    ),
)  # fmt: skip


def patched(name: str, edit: Edit, text: str) -> str:
    """`text` with the edit's anchor replaced; the anchor must occur exactly once (else the code moved on and the
    injection `name` must follow it)."""
    count = text.count(edit.anchor)
    if count != 1:
        raise SystemExit(f"{name}: its anchor occurs {count} times in {edit.path}; update the self-test")
    return text.replace(edit.anchor, edit.replacement)


def harness(*args: str, env: dict | None = None, cwd: Path = ROOT, prefix: tuple[str, ...] = ()) -> tuple[int, str]:
    """Run `harness ARGS` with this Python; its exit code and output (also echoed)."""
    command = [*prefix, sys.executable, "-m", "harness.cli", *args]
    print("$", shlex.join(command), flush=True)
    proc = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(proc.stdout, end="", flush=True)
    return proc.returncode, proc.stdout


def failed_bands(output: str) -> set[tuple[str, str]]:
    """(method, metric) of every ABOVE, BELOW or MISSING row of `harness check`'s table."""
    found = set()
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] in ("ABOVE", "BELOW", "MISSING"):
            found.add((cells[1], cells[3]))
    return found


def clean_check(baseline: Path, out: Path, taskset: str | None, hog: bool) -> tuple[int, Path]:
    runs = out / "clean"
    prefix = ("taskset", "-c", taskset) if taskset else ()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if hog else None
    try:
        code, _ = harness("check", "--baseline", str(baseline), "--out", str(runs), prefix=prefix)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    return code, runs


def inject(injection: Injection, baseline: Path, clean: Path, out: Path) -> tuple[bool, set[tuple[str, str]]]:
    """Remake the injected method's runs with the patched code; whether the check caught it, and what failed."""
    work = out / injection.name
    code = work / "code"
    for name in CODE_PATHS:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, code / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.exists():
            shutil.copy2(source, code / name)
    for edit in injection.edits:
        target = code / edit.path
        target.write_text(patched(injection.name, edit, target.read_text()))
    env = {**os.environ, "PYTHONPATH": str(code)}
    for command in sweep_command(load_baseline(baseline), str(work / "runs"), methods=[injection.method]):
        words = shlex.split(command)[1:]  # without the leading `harness`
        status, _ = harness(*words, env=env, cwd=code)
        if status != 0:
            return False, {("sweep", f"exit {status}")}
    held = work / "check"
    for run in sorted((clean / "runs").iterdir()):
        if not run.name.startswith(".") and not run.name.startswith(f"{injection.method}-"):
            shutil.copytree(run, held / "clean" / run.name)
    shutil.copytree(work / "runs" / "runs", held / "injected")
    # The reference code's runs of the clean check (harness/analysis/experiments/reference_code.py): the injected
    # runs' step overhead is held to what the known code measured on this machine, as in the clean check.
    reference = clean / REFERENCE_CODE_FOLDER
    paired = ("--reference-results", str(reference)) if (reference / "sweep.json").is_file() else ()
    status, output = harness("check", "--baseline", str(baseline), "--results", str(held), *paired)
    failed = failed_bands(output)
    return status == 1 and (injection.method, injection.metric) in failed, failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, default=ROOT / "results/reference/baseline.yaml")
    parser.add_argument("--results", type=Path, help="the runs of a clean `harness check` (skips making them)")
    parser.add_argument("--out", type=Path, help="where the runs and scratch copies go [default: a temp folder]")
    parser.add_argument("--only", nargs="+", choices=[i.name for i in INJECTIONS], help="these injections only")
    parser.add_argument("--taskset", metavar="CPUS", help="run the clean check under taskset -c CPUS")
    parser.add_argument("--hog", action="store_true", help="run the clean check beside a process spinning on a CPU")
    parser.add_argument("--clean-only", action="store_true", help="run the clean check only")
    args = parser.parse_args()
    baseline = args.baseline.resolve()
    out = (args.out or Path(tempfile.mkdtemp(prefix="gate-selftest-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    if args.results:
        clean, clean_ok = args.results.resolve(), True
    else:
        code, clean = clean_check(baseline, out, args.taskset, args.hog)
        clean_ok = code == 0
        condition = " ".join(filter(None, [f"taskset -c {args.taskset}" if args.taskset else "", "hog" * args.hog]))
        rows.append(("clean check" + (f" ({condition})" if condition else ""), "every band holds", clean_ok, ""))
    if not args.clean_only and clean_ok:
        for injection in INJECTIONS:
            if args.only and injection.name not in args.only:
                continue
            caught, failed = inject(injection, baseline, clean, out)
            shown = ", ".join(f"{m} {k}" for m, k in sorted(failed)) or "nothing"
            rows.append((injection.name, f"{injection.method} {injection.metric} fails", caught, shown))
    print(f"\ngate self-test ({out}):")
    width = max(len(r[0]) for r in rows)
    for name, expected, ok, seen in rows:
        verdict = "ok    " if ok else "FAILED"
        print(f"  {verdict} {name.ljust(width)}  expected: {expected}" + (f"; failed: {seen}" if seen else ""))
    return 0 if all(r[2] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
