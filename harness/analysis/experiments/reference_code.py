"""The baseline's reference code, run on the checking machine.

A step's own time over its forward and backward (step_overhead) is the same on a faster or a busier machine of one
kind, but not across CPUs: a memory-bound compression weighs differently against a compute-bound forward and
backward on another processor (CocktailSGD read 2.25 on one host of the pool CI draws from and 1.76 on another with
the same code, DeMo 1.30 and 1.42), and the link wait's residual over the link model's prediction moves with how
the host overlaps compute and sends (DiLoCoX's 0.970 on one host, 0.923-0.929 on another, same code). A reference
stored from one machine cannot hold such a metric on the next. So a
baseline may name a commit (`reference_code:`), and `harness check` makes the same runs with that commit's code on
the machine it checks, method by method in turn with the checkout's runs, and holds the checkout to what the known
code measured there (harness/analysis/gate/check.py).

The code comes out of the checkout's own git history (`git archive` of the paths a run imports), and its runs are
made by its own `harness sweep`, run by this Python with PYTHONPATH at the copy (which comes before the editable
install of the checkout on the import path), into OUT/reference-code (bands.REFERENCE_CODE_FOLDER), a sweep folder
of its own.
"""

from __future__ import annotations

import io
import os
import shlex
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

from harness.analysis.gate.bands import Baseline, BaselineError, sweep_command
from harness.run.summary import CODE_PATHS

CHECKOUT = Path(__file__).resolve().parents[3]
COMMIT_FILE = "COMMIT"  # in the copy: which commit it is, so a resumed check reuses it


def _git(*args: str, repo: Path) -> subprocess.CompletedProcess:
    # The harness may run as root of its own user namespace, where git calls the checkout "dubious ownership".
    command = ["git", "-c", f"safe.directory={repo}", "-C", str(repo), *args]
    try:
        return subprocess.run(command, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        raise BaselineError(f"could not run git to get the baseline's reference code ({err}); install git") from None


def resolve_commit(revision: str, repo: Path = CHECKOUT) -> str:
    """The full commit `revision` names in the checkout's history; one sentence where it names none."""
    found = _git("rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}", repo=repo)
    if found.returncode != 0:
        raise BaselineError(f"{revision!r} names no commit of {repo}; give a commit of its history (git log)")
    return found.stdout.decode().strip()


def extract(commit: str, dest: Path, repo: Path = CHECKOUT) -> Path:
    """The code of `commit` (CODE_PATHS that it has) written to `dest`, or the copy already there."""
    marker = dest / COMMIT_FILE
    if marker.is_file() and marker.read_text().strip() == commit:
        return dest
    listed = _git("ls-tree", "--name-only", commit, repo=repo)
    if listed.returncode != 0:
        raise BaselineError(
            f"the baseline's reference code {commit[:12]} is not in the history of {repo} (a shallow clone?); fetch "
            "it (git fetch --unshallow), or pass --stored-references to hold every band to the stored references"
        )
    present = set(listed.stdout.decode().split())
    paths = [p for p in CODE_PATHS if p in present]
    archive = _git("archive", "--format=tar", commit, "--", *paths, repo=repo)
    if archive.returncode != 0:
        raise BaselineError(f"git archive of {commit[:12]} failed: {archive.stderr.decode().strip()}")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    marker.write_text(commit + "\n")
    return dest


def run_reference(
    baseline: Baseline, commit: str, out: Path, methods: Sequence[str] | None = None, repo: Path = CHECKOUT
) -> None:
    """Make (or resume) the runs of `methods` (all, where None) that the baseline needs, with the code of `commit`
    in `repo`'s history, into the sweep folder `out`; its own progress is printed as it goes."""
    out = out.resolve()
    code = extract(commit, out / "code", repo)
    env = {**os.environ, "PYTHONPATH": str(code)}
    for command in sweep_command(baseline, str(out), methods=methods, force=False):
        words = shlex.split(command)[1:]  # without the leading `harness`
        done = subprocess.run([sys.executable, "-m", "harness.cli", *words], cwd=code, env=env)
        if done.returncode != 0:
            raise BaselineError(
                f"the reference code's sweep ({commit[:12]}: {shlex.join(words)}) exited {done.returncode}; its "
                f"runs are in {out}, and --stored-references holds every band to the stored references instead"
            )
