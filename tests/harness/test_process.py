"""Work in a killable child: its result and exceptions come back, and Ctrl-C ends it at once, even in native code."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from harness.process import run_interruptibly
from tests.harness.e2e import HARNESS


def test_the_childs_result_and_exception_come_back() -> None:
    assert run_interruptibly(lambda: os.getpid()) != os.getpid()
    with pytest.raises(ValueError, match="bad input"):
        run_interruptibly(lambda: (_ for _ in ()).throw(ValueError("bad input")))


def _children(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in children.read_text().split()] if children.exists() else []


def test_ctrl_c_during_bpe_training_ends_the_command_within_two_seconds(tmp_path: Path) -> None:
    """The tokenizers library trains without releasing the GIL: in the harness's own process Ctrl-C waited until
    training ended (over 60 s on a large corpus). The corpus here trains for ~10 s: 200 words of 19,000 letters."""
    pytest.importorskip("tokenizers")
    letters = random.Random(0)
    corpus = tmp_path / "words.txt"
    corpus.write_text("\n".join("".join(letters.choices("abcdefgh", k=19_000)) for _ in range(200)))
    env = {**os.environ, "HARNESS_CACHE_DIR": str(tmp_path / "cache")}
    command = [*HARNESS, "run", "--tokenizer", "bpe:4096", "--data", str(corpus), "--out", str(tmp_path / "runs")]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _children(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _children(proc.pid), f"the check never started training: {proc.communicate()[0]}"
        time.sleep(1.0)  # into the training, which holds the child's GIL from here on
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        output, _ = proc.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert took < 2.0, f"Ctrl-C took {took:.1f} s to end the command"
    assert proc.returncode == 128 + signal.SIGINT, output
    assert "interrupted by SIGINT before the run started; nothing was created" in output, output
    assert not list((tmp_path / "cache").rglob("bpe-*.json")), "an interrupted training left a tokenizer behind"
    assert not (tmp_path / "runs").exists()
