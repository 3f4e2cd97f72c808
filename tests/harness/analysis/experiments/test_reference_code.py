"""The baseline's reference code (harness/analysis/experiments/reference_code.py): taken out of git history and run
by its own `harness sweep`, not the checkout's, with the baseline's settings."""

from __future__ import annotations

import json
import subprocess

import pytest

from harness.analysis.experiments.reference_code import COMMIT_FILE, extract, resolve_commit, run_reference
from harness.analysis.gate.bands import Baseline, BaselineError, MethodCheck

# A stand-in for the harness of another commit: its CLI records how it was called and which file it ran from.
FAKE_CLI = """import json, os, sys
from pathlib import Path
out = Path(sys.argv[sys.argv.index("--out") + 1])
out.mkdir(parents=True, exist_ok=True)
with open(out / "calls.jsonl", "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "file": __file__, "cwd": os.getcwd()}) + "\\n")
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
"""


def _git(repo, *args):
    command = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A repository of two commits: the first has the fake harness, the second changes it and adds docs/."""
    repo = tmp_path / "repo"
    (repo / "harness" / "cli").mkdir(parents=True)
    (repo / "harness" / "__init__.py").write_text("")
    (repo / "harness" / "cli" / "__init__.py").write_text("")
    (repo / "harness" / "cli" / "__main__.py").write_text(FAKE_CLI)
    (repo / "pyproject.toml").write_text("[project]\nname = 'fake'\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "first")
    first = _git(repo, "rev-parse", "HEAD")
    (repo / "harness" / "cli" / "__main__.py").write_text("raise SystemExit('the newer code ran')\n")
    (repo / "docs").mkdir()
    (repo / "docs" / "x.md").write_text("x")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "second")
    return repo, first


def test_extract_writes_the_commits_code_only_and_reuses_it(repo, tmp_path):
    repo, first = repo
    code = extract(first, tmp_path / "code", repo=repo)
    assert (code / "harness" / "cli" / "__main__.py").read_text() == FAKE_CLI
    assert not (code / "docs").exists() and (code / "pyproject.toml").is_file()
    assert (code / COMMIT_FILE).read_text().strip() == first
    (code / "harness" / "kept").write_text("")
    assert extract(first, code, repo=repo) == code and (code / "harness" / "kept").exists()


def test_a_commit_not_in_the_history_is_one_sentence(repo, tmp_path):
    repo, _ = repo
    with pytest.raises(BaselineError, match=r"reference code 0123456789ab is not in the history of .* fetch it"):
        extract("0123456789abcdef0123456789abcdef01234567", tmp_path / "code", repo=repo)
    assert not (tmp_path / "code").exists()
    with pytest.raises(BaselineError, match="'nope' names no commit of"):
        resolve_commit("nope", repo=repo)
    assert resolve_commit("HEAD~1", repo=repo) == _git(repo, "rev-parse", "HEAD~1")


def test_run_reference_runs_that_commits_own_sweep_with_the_baselines_settings(repo, tmp_path, monkeypatch):
    """Its own code, not the checkout's installed one: PYTHONPATH at the copy comes first on the import path."""
    repo, first = repo
    baseline = Baseline(
        (MethodCheck("allreduce", "100mbps", ()), MethodCheck("dilocox", "10mbps", ())),
        {"model": "tiny", "steps": 40},
        {"dilocox": {"local_steps": 10}},
        repeats=3,
    )
    out = tmp_path / "check" / "reference-code"
    run_reference(baseline, first, out, ["dilocox"], repo=repo)
    calls = [json.loads(line) for line in (out / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 1
    argv = calls[0]["argv"]
    assert argv[:5] == ["sweep", "--methods", "dilocox", "--profiles", "10mbps"]
    assert argv[argv.index("--repeats") + 1] == "3" and "--force" not in argv, "resumed, not redone"
    assert "dilocox.local_steps=10" in argv and argv[-1] == str(out.resolve())
    assert calls[0]["file"].startswith(str(out.resolve() / "code"))
    monkeypatch.setenv("FAKE_EXIT", "3")
    with pytest.raises(BaselineError, match=r"the reference code's sweep \(.*\) exited 3"):
        run_reference(baseline, first, out, repo=repo)
