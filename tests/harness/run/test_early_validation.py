"""Everything that can be checked before the cluster is built is: data, floats, bursts, output paths, profiles.

Each bad input is refused with exit code 2 and one line starting "error:" that names the fix, with no traceback, and
nothing is created: no namespace, no link, no results folder (not even an empty results/runs/). The CLI runs
in-process; the real run is replaced by a sentinel, so input that wrongly passes validation fails the test at once
instead of building a cluster.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

import harness.cli as cli
import harness.run.runner as runner
from harness.errors import UserError
from harness.net.link import MIN_BURST_BYTES, LinkSpec, ProfileError
from harness.net.profiles import load_profile
from harness.run.config import RunConfig
from harness.run.folder import DEFAULT_RUNS_DIR, ResultsError, RunFolder
from tests.harness.refusal import (
    assert_refused,
    assert_started,
)
from trainers.config import OptimConfig, TrainConfig
from trainers.registry import method_options

SEQ_LEN = 64  # passed explicitly, so data sizes below do not depend on the default model's context
# Transformers configs as config.json holds them, narrow so that validating them (which builds the model on the meta
# device) stays fast.
GPT2_CONFIG = json.dumps(
    {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 128, "vocab_size": 512}
)
OPT_TIED_CONFIG = json.dumps(
    {
        "model_type": "opt",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "ffn_dim": 128,
        "num_attention_heads": 4,
        "word_embed_proj_dim": 64,
        "max_position_embeddings": 128,
        "vocab_size": 512,
        "tie_word_embeddings": True,
    }
)


@dataclass
class Case:
    id: str
    args: list[str]
    expect: list[str]
    files: dict[str, str | bytes | None] = field(default_factory=dict)  # None: a folder
    absent: list[str] = field(default_factory=list)


LONG = "o" * 300  # over any file system's 255-byte NAME_MAX
STAGING_TOO_LONG = "s" * 250  # fits NAME_MAX, but ".<name>.partial" does not
DEEP = "/".join(["d" * 200] * 22)  # 4,400 bytes: over PATH_MAX

CASES = [
    # --- data ---------------------------------------------------------------------------------------------------
    Case(
        "data-missing",
        ["run", "--data", "{tmp}/nope"],
        ["--data {tmp}/nope does not exist", "pass a text file or a folder of text files"],
    ),
    Case(
        "data-empty-folder",
        ["run", "--data", "{tmp}/corpus"],
        ["--data folder {tmp}/corpus holds no files", "whatever its extension", "hidden", "add text files"],
        files={"corpus": None},
    ),
    Case(
        "data-folder-only-hidden-files",
        ["run", "--data", "{tmp}/corpus"],
        ["holds no files", "hidden ones such as .git"],
        files={"corpus": None, "corpus/.git": None, "corpus/.git/HEAD": "ref: refs/heads/main\n"},
    ),
    Case(
        "data-folder-of-binaries",
        ["run", "--data", "{tmp}/corpus"],
        ["holds no text", "not UTF-8 text (image.bin)", "add UTF-8 text files (any extension)"],
        files={"corpus": None, "corpus/image.bin": bytes([0xFF, 0xFE, 0x00]) * 100, "corpus/empty.txt": ""},
    ),
    Case(
        "data-binary-file",
        ["run", "--data", "{tmp}/model.bin"],
        ["--data {tmp}/model.bin is not UTF-8 text", "pass a text file"],
        files={"model.bin": bytes(range(256)) * 40},
    ),
    Case("data-empty-file", ["run", "--data", "{tmp}/e.txt"], ["--data {tmp}/e.txt is empty"], files={"e.txt": ""}),
    Case(
        "data-one-byte-file",
        ["run", "--data", "{tmp}/one.txt", "--seq-len", str(SEQ_LEN)],
        ["holds 1 byte of text", "seq_len + 1 = 65", "pass at least 1,300 bytes of text", "shorter --seq-len"],
        files={"one.txt": "x"},
    ),
    Case(
        "data-file-one-byte-short",
        ["run", "--data", "{tmp}/short.txt", "--seq-len", str(SEQ_LEN)],
        ["holds 1,299 bytes", "at least 1,300 bytes"],
        files={"short.txt": "y" * 1299},
    ),
    Case(
        "data-training-shards-too-small",
        ["run", "--data", "{tmp}/corpus", "--seq-len", str(SEQ_LEN)],
        ["training split (100 bytes) gives each of 2 clusters 50 bytes", "fewer than seq_len + 1 = 65", "--clusters"],
        files={"corpus": None, "corpus/a.txt": "a" * 100, "corpus/b.txt": "b" * 5000},
    ),
    Case(
        "data-held-out-too-small",
        ["run", "--data", "{tmp}/corpus", "--seq-len", str(SEQ_LEN)],
        ["held-out split (b.txt: 10 bytes)", "seq_len + 1 = 65", "every 20th file"],
        files={"corpus": None, "corpus/a.txt": "a" * 5000, "corpus/b.txt": "b" * 10},
    ),
    Case(
        "data-name-too-long",
        ["run", "--data", "{tmp}/" + LONG],
        ["cannot read --data", "File name too long"],
    ),
    # --- floats -------------------------------------------------------------------------------------------------
    Case("lr-nan", ["run", "--lr", "nan"], ["--lr must be a positive finite number, got nan"]),
    Case("lr-inf", ["run", "--lr", "inf"], ["--lr must be a positive finite number, got inf"]),
    Case("lr-negative", ["run", "--lr", "-1"], ["--lr must be a positive finite number, got -1"]),
    Case("lr-zero", ["run", "--lr", "0"], ["--lr must be a positive finite number, got 0"]),
    Case("seed-negative", ["run", "--seed", "-1"], ["--seed must be in [0, 2**64), got -1"]),
    Case("microbatches-negative", ["run", "--microbatches", "-1"], ["--microbatches must be at least 0"]),
    # --- method settings the model decides ----------------------------------------------------------------------
    Case(
        "reduce-rank-above-every-matrix",
        ["run", "--method", "dilocox", "--set", "exchange=reduce", "--set", "rank=200"],
        ["rank=200 leaves no matrix of this model factored under exchange=reduce", "use --set rank=102 or lower"],
    ),
    Case(
        "reduce-without-compression",
        ["run", "--method", "dilocox", "--set", "exchange=reduce", "--set", "compression=false"],
        ["exchange=reduce reduces low-rank factors, which compression=false turns off"],
    ),
    # --- burst --------------------------------------------------------------------------------------------------
    Case(
        "burst-below-a-packet",
        ["run", "--profile", "{tmp}/tiny-burst.yaml"],
        [
            "tiny-burst.yaml: inter_cluster: burst 1kb is below one full-size packet (1,514 bytes)",
            "tbf would drop every full-size packet; use at least 2kb",
        ],
        files={"tiny-burst.yaml": "inter_cluster:\n  rate: 100mbit\n  burst: 1kb\n"},
    ),
    # --- output paths -------------------------------------------------------------------------------------------
    Case(
        "out-name-over-255-bytes",
        ["run", "--out", "{tmp}/" + LONG],
        ["is 300 bytes, more than the 246 this file system allows", "pass a shorter --out"],
    ),
    Case(
        "out-staging-name-over-255-bytes",
        ["run", "--out", "{tmp}/" + STAGING_TOO_LONG],
        ["is 250 bytes, more than the 246", ".<name>.partial must fit in 255", "pass a shorter --out"],
    ),
    Case(
        "out-parent-name-over-255-bytes",
        ["run", "--out", "{tmp}/" + LONG + "/run"],
        ["folder name", "is 300 bytes, more than the 255 this file system allows", "pass a shorter --out"],
    ),
    Case(
        "out-path-over-path-max",
        ["run", "--out", "{tmp}/" + DEEP],
        ["too long for this file system's 4,096-byte paths", "pass a shorter --out"],
    ),
    Case(
        "out-being-written",
        ["run", "--out", "{tmp}/o"],
        ["results folder {tmp}/o is being written by another run now", "{tmp}/.o.partial", "remove {tmp}/.o.partial"],
        files={".o.partial": None, ".o.partial/config.json": "{}\n"},
    ),
    Case(
        "out-under-proc",
        ["run", "--out", "/proc/harness-test-out"],
        ["cannot write results under /proc (it ", "pass a writable --out"],
        absent=["No such file"],
    ),
    # --- your own data, tokenizer and model -------------------------------------------------------------------
    Case(
        "jsonl-without-the-text-field",
        ["run", "--data", "{tmp}/d.jsonl"],
        ["{tmp}/d.jsonl line 2 has no 'text' field (it has 'body')", "pass --data-field"],
        files={"d.jsonl": '{"text": "a"}\n{"body": "b"}\n'},
    ),
    Case(
        "jsonl-line-not-json",
        ["run", "--data", "{tmp}/d.jsonl"],
        ["{tmp}/d.jsonl line 1 is not JSON", "fix it or leave the file out"],
        files={"d.jsonl": "not json\n"},
    ),
    Case(
        "tokenizer-unknown",
        ["run", "--tokenizer", "gpt2"],
        ["--tokenizer gpt2 is not bytes, bpe:N or an existing tokenizer.json", "nothing is downloaded"],
    ),
    Case(
        "tokenizer-bpe-too-small",
        ["run", "--tokenizer", "bpe:100"],
        ["bpe:N needs a vocabulary N of at least 258", "e.g. bpe:4096"],
    ),
    # Printed as text: rich once read ":-1:" and ":warning:" as emoji codes.
    Case(
        "tokenizer-text-not-read-as-emoji",
        ["run", "--tokenizer", "bpe:-1"],
        ["--tokenizer bpe:-1: bpe:N needs a vocabulary N of at least 258"],
    ),
    Case(
        "data-path-not-read-as-emoji-or-markup",
        ["run", "--data", "{tmp}/a:warning:[bold]b"],
        ["--data {tmp}/a:warning:[bold]b does not exist"],
    ),
    Case(
        "tokenizer-file-not-a-tokenizer",
        ["run", "--tokenizer", "{tmp}/tokenizer.json"],
        ["is not a tokenizers JSON file", "pass a tokenizer.json"],
        files={"tokenizer.json": "{}"},
    ),
    Case(
        "model-missing-config",
        ["run", "--model", "{tmp}/nomodel"],
        ["is neither a built-in model nor a local path", "the harness never downloads", "pass a directory"],
    ),
    Case(
        "model-folder-without-config",
        ["run", "--model", "{tmp}/m"],
        ["has no config.json", "save the transformers config into it"],
        files={"m": None},
    ),
    Case(
        "model-config-not-json",
        ["run", "--model", "{tmp}/m/config.json"],
        ["is not readable JSON", "fix or replace it"],
        files={"m/config.json": "{not json"},
    ),
    Case(
        "model-architecture-not-cut-by-stages",
        ["run", "--model", "{tmp}/m", "--stages", "2", "--seq-len", str(SEQ_LEN)],
        ["is a gpt2 model", "pipeline stages cut only opt, llama, qwen2", "use --stages 1"],
        files={"m/config.json": GPT2_CONFIG},
    ),
    Case(
        "model-tied-head-across-stages",
        ["run", "--model", "{tmp}/m", "--stages", "2", "--seq-len", str(SEQ_LEN)],
        ["ties its lm head to the token embedding", "use --stages 1 or a model with untied embeddings"],
        files={"m/config.json": OPT_TIED_CONFIG},
    ),
    Case(
        "tokenizer-larger-than-the-models-vocabulary",
        ["run", "--model", "{tmp}/m", "--tokenizer", "bpe:1024", "--seq-len", str(SEQ_LEN)],
        ["the tokenizer has 1024 tokens but model", "embeds 512", "vocab_size >= 1024"],
        files={"m/config.json": GPT2_CONFIG},
    ),
    Case(
        "model-larger-than-the-hosts-memory",
        ["run", "--model", "{tmp}/m", "--seq-len", str(SEQ_LEN)],
        ["the model has", "M parameters: 2 rank(s) need at least", "TiB", "available", "use a smaller --model"],
        files={
            "m/config.json": GPT2_CONFIG.replace('"n_embd": 64', '"n_embd": 65536').replace(
                '"n_head": 4', '"n_head": 64'
            )
        },
    ),
    Case(
        "model-hub-name",
        ["run", "--model", "facebook/opt-125m"],
        ["facebook/opt-125m", "local"],
    ),
    # --- profiles -----------------------------------------------------------------------------------------------
    Case(
        "profile-is-a-folder",
        ["run", "--profile", "{tmp}/profiles"],
        ["profile {tmp}/profiles is a folder; pass a profile YAML file or one of:", "1gbps"],
        files={"profiles": None},
        absent=["does not exist"],
    ),
    Case(
        "profile-is-a-folder-by-bare-name",
        ["run", "--profile", "profiles"],
        ["profile profiles is a folder; pass a profile YAML file", "1gbps"],
        files={"profiles": None},
    ),
    Case(
        "profile-name-makes-run-id-too-long",
        ["run", "--profile", "{tmp}/" + "p" * 240 + ".yaml"],
        ["run id", "too long for a results folder name", "rename the profile file", "or pass --out"],
        files={"p" * 240 + ".yaml": "inter_cluster:\n  rate: 1gbit\n"},
    ),
]


def prepare(case: Case, tmp_path: Path) -> list[str]:
    for name, content in case.files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            path.mkdir(parents=True)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return [arg.replace("{tmp}", str(tmp_path)) for arg in case.args]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_refused_before_anything_is_created(case, harness_cli, tmp_path):
    args = prepare(case, tmp_path)
    result, before, after = harness_cli(args)
    expect = [e.replace("{tmp}", str(tmp_path)) for e in case.expect]
    assert_refused(result, before, after, expect, case.absent)
    assert not (tmp_path / "results").exists()


def test_a_fifo_is_not_data(harness_cli, tmp_path):
    os.mkfifo(tmp_path / "pipe")
    result, before, after = harness_cli(["run", "--data", str(tmp_path / "pipe")])
    assert_refused(result, before, after, ["is neither a file nor a folder", "pass a text file or a folder"])


# --- what is accepted ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "files",
    [
        {"book.txt": "z" * 1300},  # exactly the minimum for seq_len 64 on 2 clusters
        {"corpus": None, "corpus/a.md": "a" * 200, "corpus/b.rst": "b" * 100, "corpus/logo.png": b"\x89PNG\xff"},
    ],
    ids=["file-at-the-minimum", "folder-with-a-binary-among-text"],
)
def test_enough_text_reaches_the_run(files, harness_cli, tmp_path):
    prepare(Case("", [], [], files), tmp_path)
    data = tmp_path / next(iter(files))
    result, before, after = harness_cli(["run", "--data", str(data), "--seq-len", str(SEQ_LEN), "--out", "o"])
    assert_started(result)
    assert after == before


def test_a_burst_without_a_rate_does_not_matter(tmp_path):
    path = tmp_path / "delay-only.yaml"
    path.write_text("inter_cluster:\n  delay: 10ms\n  burst: 1kb\n")
    assert load_profile(str(path)).inter_cluster.burst_bytes == 1024


@pytest.mark.parametrize(("burst", "ok"), [(f"{MIN_BURST_BYTES - 1}b", False), (f"{MIN_BURST_BYTES}b", True)])
def test_the_smallest_burst_is_one_full_size_frame(tmp_path, burst, ok):
    path = tmp_path / "edge.yaml"
    path.write_text(f"inter_cluster:\n  rate: 10mbit\n  burst: {burst}\n")
    if ok:
        assert load_profile(str(path)).inter_cluster.burst_bytes == MIN_BURST_BYTES
    else:
        with pytest.raises(ProfileError, match=rf"burst {burst} is below one full-size packet"):
            load_profile(str(path))


def test_a_linkspec_built_in_python_refuses_a_tiny_burst_too():
    with pytest.raises(ProfileError, match="burst 1000b is below one full-size packet"):
        LinkSpec(rate_bps=10**9, burst_bytes=1000)
    assert LinkSpec(burst_bytes=1000).burst_bytes == 1000  # unshaped: tbf is not used


def test_a_long_profile_name_is_fine_with_out(harness_cli, tmp_path):
    profile = tmp_path / ("p" * 240 + ".yaml")
    profile.write_text("inter_cluster:\n  rate: 1gbit\n")
    result, before, after = harness_cli(["run", "--profile", str(profile), "--out", "short"])
    assert_started(result)
    assert after == before


# --- the userspace delay line's TUN device ----------------------------------------------------------------------

TUN = "/dev/net/tun"
NO_NETEM = {"tbf": True, "htb": True, "netem": False, "ifb": False}
TUN_REFUSAL = [
    f"the userspace delay line needs to open {TUN} read-write",
    "run as root, give this user access to it (e.g. chmod 0666 /dev/net/tun, as most distributions ship it)",
    "or use a kernel with sch_netem",
]


def test_a_tun_device_this_user_cannot_open_is_refused_before_anything_is_built(harness_cli, monkeypatch):
    """/dev/net/tun existed, so the run built its cluster and then failed: its delay line could not open it."""
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if os.fspath(path) == TUN:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(runner, "probe_qdiscs", lambda userns: NO_NETEM)
    result, before, after = harness_cli(["run", "--profile", "wan-1gbps-40ms-rtt", "--out", "o"])
    assert_refused(result, before, after, TUN_REFUSAL)


def test_a_tun_device_this_user_can_open_is_accepted(harness_cli, monkeypatch):
    if not os.access(TUN, os.R_OK | os.W_OK):
        pytest.skip(f"this user cannot open {TUN}")
    monkeypatch.setattr(runner, "probe_qdiscs", lambda userns: NO_NETEM)
    result, before, after = harness_cli(["run", "--profile", "wan-1gbps-40ms-rtt", "--out", "o"])
    assert_started(result)
    assert after == before


def test_a_real_user_who_cannot_open_tun_is_refused_before_the_cluster_is_built(tmp_path):
    """As user nobody, on a machine whose /dev/net/tun is root's alone (0600): exit 2, one line, nothing made."""
    if os.geteuid() != 0 or not os.path.exists(TUN) or os.stat(TUN).st_mode & 0o006 == 0o006:
        pytest.skip(f"needs root (to become nobody) and a {TUN} that other users cannot open")
    repo = Path(cli.__file__).resolve().parents[2]
    site = next(Path(sys.prefix, "lib").glob("python3*/site-packages"))
    python = "/usr/bin/python3"  # the tests' own interpreter may live where nobody cannot read (/root/.pyenv)
    home = Path(tempfile.mkdtemp(prefix="harness-nobody-", dir="/tmp"))
    try:
        home.chmod(0o777)
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "PYTHONPATH": f"{repo}:{site}", "COLUMNS": "300"}
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-m", "harness.cli"]
        probe = subprocess.run([*nobody, "--help"], capture_output=True, text=True, cwd=home, env=env, timeout=60)
        if probe.returncode != 0:
            pytest.skip(f"user nobody cannot run the harness with {python}: {probe.stderr.strip()[-200:]}")
        args = ["run", "--profile", "wan-1gbps-40ms-rtt", "--link-emulator", "userspace", "--steps", "5",
                "--model", "tiny", "--out", str(home / "o")]  # fmt: skip
        result = subprocess.run([*nobody, *args], capture_output=True, text=True, cwd=home, env=env, timeout=120)
        text = " ".join((result.stdout + result.stderr).split())
        assert result.returncode == 2, text
        assert "Traceback" not in text
        for expected in TUN_REFUSAL:
            assert expected in text, text
        assert not (home / "o").exists() and not list(home.glob(".o*"))
    finally:
        shutil.rmtree(home, ignore_errors=True)


# --- floats -------------------------------------------------------------------------------------------------------


def float_options() -> list[tuple[str, str]]:
    """(method, flag) for every float option of every method's config."""
    return [
        (method, "--" + name.replace("_", "-"))
        for name, (kind, defaults, _) in sorted(method_options().items())
        if kind is float or kind == "float"
        for method in sorted(defaults)
    ]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize(("method", "flag"), float_options())
def test_no_method_float_option_takes_nan_or_inf(method, flag, value, harness_cli):
    result, before, after = harness_cli(["run", "--method", method, flag, value])
    assert_refused(result, before, after, [flag])


def test_there_are_float_method_options_to_test():
    assert ("opendiloco", "--outer-lr") in float_options()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(lr=math.nan), "--lr must be a positive finite number, got nan"),
        (dict(lr=math.inf), "--lr must be a positive finite number, got inf"),
        (dict(lr=0.0), "--lr must be a positive finite number, got 0.0"),
        (dict(weight_decay=math.nan), "weight_decay must be a finite number of at least 0, got nan"),
        (dict(weight_decay=-0.1), "weight_decay must be a finite number of at least 0"),
        (dict(betas=(0.9, math.nan)), r"betas must be two numbers in [0, 1), got (0.9, nan)"),
        (dict(betas=(1.0, 0.95)), "betas must be two numbers in [0, 1)"),
        (dict(betas=(0.9,)), "betas must be two numbers in [0, 1)"),
        (dict(warmup_fraction=math.inf), "warmup_fraction must be a number in [0, 1], got inf"),
        (dict(warmup_fraction=1.5), "warmup_fraction must be a number in [0, 1]"),
        (dict(min_lr_ratio=math.nan), "min_lr_ratio must be a number in [0, 1], got nan"),
        (dict(min_lr_ratio=-0.1), "min_lr_ratio must be a number in [0, 1]"),
        (dict(grad_clip=math.nan), "grad_clip must be a positive finite number, got nan"),
        (dict(grad_clip=0.0), "grad_clip must be a positive finite number"),
        (dict(grad_clip=math.inf), "grad_clip must be a positive finite number, got inf"),
    ],
)
def test_optim_config_refuses_what_adamw_cannot_use(change, message):
    bad = replace(OptimConfig(), **change)
    with pytest.raises(ValueError) as err:
        bad.validate()
    assert str(err.value) == message or message in str(err.value)
    # The run's validation reports it as the user's error.
    config = RunConfig(method="allreduce", profile=load_profile("1gbps"), train=TrainConfig(optim=bad))
    with pytest.raises(UserError, match=re.escape(message)):
        config.validate()


@pytest.mark.parametrize(
    "optim", [OptimConfig(), OptimConfig(lr=1e-2, warmup_fraction=0.0, min_lr_ratio=1.0, grad_clip=100.0)]
)
def test_optim_config_accepts_good_settings(optim):
    optim.validate()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(eval_batches=0), "eval_batches must be at least 1, got 0"),
        (dict(seed=-1), "--seed must be in [0, 2**64), got -1"),
        (dict(seed=2**64), "--seed must be in [0, 2**64)"),
        (dict(microbatches=-2), "--microbatches must be at least 0"),
    ],
)
def test_train_config_refuses_what_the_workers_would(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        replace(TrainConfig(), **change).validate()


# --- the library: RunConfig.build + runner.validate ------------------------------------------------------------


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("HARNESS_MAX_RATE", raising=False)
    return tmp_path


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(data="nope"), "--data nope does not exist"),
        (dict(data="one.txt", seq_len=SEQ_LEN), "holds 1 byte of text"),
        (dict(lr=math.nan), "--lr must be a positive finite number, got nan"),
        (dict(lr=-1.0), "--lr must be a positive finite number, got -1.0"),
    ],
)
def test_runner_validate_refuses_and_creates_nothing(in_tmp, settings, message):
    (in_tmp / "one.txt").write_text("x")
    config = RunConfig.build("allreduce", "1gbps", **settings)
    with pytest.raises(UserError, match=re.escape(message)):
        runner.validate(config, None)
    assert sorted(p.name for p in in_tmp.iterdir()) == ["one.txt"]


def test_calibration_reads_no_data(in_tmp):
    config = RunConfig.build("allreduce", "1gbps", mode="calibrate", calibrate=True, data="nope")
    runner.validate(config, in_tmp / "out")


def test_default_folder_refusal_leaves_no_results_runs(in_tmp):
    profile = in_tmp / ("q" * 240 + ".yaml")
    profile.write_text("inter_cluster:\n  rate: 1gbit\n")
    config = RunConfig.build("allreduce", str(profile))
    with pytest.raises(ResultsError, match="rename the profile file"):
        runner.validate(config, None)
    assert sorted(p.name for p in in_tmp.iterdir()) == [profile.name]


# --- the results folder ---------------------------------------------------------------------------------------


def test_create_makes_the_default_parents_and_the_staging_folder(in_tmp):
    folder = RunFolder(DEFAULT_RUNS_DIR / "r1")
    folder.check()
    assert list(in_tmp.iterdir()) == []
    assert folder.create() == DEFAULT_RUNS_DIR / ".r1.partial"
    assert (in_tmp / "results" / "runs" / ".r1.partial").is_dir()
    assert folder.commit() == DEFAULT_RUNS_DIR / "r1"


def test_a_concurrent_writer_is_refused_atomically(in_tmp):
    """Two runs that both passed check() for one folder: exactly one gets the staging folder."""
    first, second = RunFolder(in_tmp / "results" / "runs" / "same"), RunFolder(in_tmp / "results" / "runs" / "same")
    first.check()
    second.check()
    first.create()
    with pytest.raises(ResultsError, match="is being written by another run now"):
        second.create()
    assert [p.name for p in (in_tmp / "results" / "runs").iterdir()] == [".same.partial"]
    # And a third run, later, is refused by check() with the same sentence.
    with pytest.raises(ResultsError, match="is being written by another run now, or a killed run left"):
        RunFolder(in_tmp / "results" / "runs" / "same").check()


def test_racing_threads_get_one_staging_folder(in_tmp):
    final = in_tmp / "deep" / "er" / "run"
    barrier = threading.Barrier(8)
    outcomes: list[str] = []

    def race() -> None:
        folder = RunFolder(final)
        folder.check()
        barrier.wait()
        try:
            folder.create()
            outcomes.append("created")
        except ResultsError as err:
            outcomes.append(str(err))

    threads = [threading.Thread(target=race) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outcomes) == 8 and outcomes.count("created") == 1, outcomes
    assert all("another run" in o for o in outcomes if o != "created")
    assert [p.name for p in final.parent.iterdir()] == [".run.partial"]


def test_a_failed_create_removes_the_parents_it_made(in_tmp, monkeypatch):
    folder = RunFolder(DEFAULT_RUNS_DIR / "r2")
    folder.check()
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self.name == ".r2.partial":
            raise OSError(28, "No space left on device")
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(ResultsError, match=r"cannot create results folder .*No space left on device.*--out"):
        folder.create()
    assert list(in_tmp.iterdir()) == []


def test_create_refuses_a_folder_that_appeared_since_check(in_tmp):
    folder = RunFolder(in_tmp / "out")
    folder.check()
    (in_tmp / "out").mkdir()  # another run with the same --out finished meanwhile
    with pytest.raises(ResultsError, match="already exists"):
        folder.create()
    assert [p.name for p in in_tmp.iterdir()] == ["out"]


def test_check_creates_nothing_when_it_passes(in_tmp):
    RunFolder(in_tmp / "a" / "b" / "c").check()
    RunFolder(DEFAULT_RUNS_DIR / "x").check()
    assert list(in_tmp.iterdir()) == []
