#!/usr/bin/env python3
"""The hostile round: bad or unusual inputs a new user could give, each run against the real CLI and judged.

The project's rule for bad input: a clear error in one plain sentence naming the fix, before anything is created on
the host; an option that does not apply is refused or warned about, never silently ignored; no traceback; text the
user gave is printed as text (never read as rich markup or emoji codes). Each case below states what it expects, and
is judged by that kind's rule:

    refuse   exit code not 0; no "Traceback"; a line starting "error:"; at most 3 non-empty lines and 600
             characters of output in all; within 10 s; nothing new on the host (network namespaces, links in the
             host's namespace, run locks, harness temp folders, the corpus cache, files under this round's temp
             folder: a refusal must not leave a results folder).
    warn     exit code 0, no "Traceback", and a line starting "warning:".
    work     exit code 0 and no "Traceback".
    notice   an option that does not apply: held as `refuse`, or exit 0 with a "warning:" line (refused or warned
             about, never silently ignored).

A case may also name text the output must hold exactly as typed (`literal`: user input such as "[bold]" or
":warning:", which markup or emoji codes would swallow), and a path under its working folder that must exist after
it (`makes`, a glob).

Every case runs in a fresh working folder of its own (so results/runs lands there), under a temp folder that also
holds the fixtures (damaged runs, bad profiles, broken model configs), built by this script. Commands that train
(run, sweep, compare, regime) get `--steps 3 --batch-size 2 --seq-len 64` and an unshaped profile right after the
command where the case does not set them, so that one that is wrongly accepted ends in seconds rather than at its
timeout. A case still running at its timeout (30 s unless it says otherwise) gets SIGTERM for its process group
(the harness tears down what it built on SIGTERM), then SIGKILL 10 s later.

Only the `warn` and `work` cases of `run`, and a `notice` case the harness silently accepts, train for real (3 steps
of the tiny model). Run the round on a host where no other harness is at work: its namespaces and temp folders
would count against whichever case was running.

    .venv/bin/python scripts/hostile-inputs.py --out /tmp/hostile.md
    .venv/bin/python scripts/hostile-inputs.py --only '^profiles show'    # a subset (a regex on the arguments)
    .venv/bin/python scripts/hostile-inputs.py --list                     # the catalogue, numbered

Prints a markdown table, one row per case, and "N of M hold"; exits 1 when a case does not hold.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[1]
# A small finished run (2 ranks, 20 steps) that the damaged-run fixtures are copies of.
TEMPLATE_RUN = ROOT / "results" / "reference" / "regime-tiny" / "runs" / "allreduce-paper-107b-s3"
BASELINE = "{repo}/results/reference/baseline.yaml"

Expect = Literal["refuse", "warn", "work", "notice"]
EXPECTATIONS: tuple[Expect, ...] = ("refuse", "warn", "work", "notice")
PLACES = ("fx", "repo", "cwd")  # the {name}s a case's arguments may hold

REFUSAL_SECONDS = 10.0
REFUSAL_LINES = 3
REFUSAL_CHARS = 600
TERM_GRACE_S = 10.0

# Flags that bound a training command the harness wrongly accepts; one the case already gives is not added.
BOUNDS: dict[str, tuple[str, ...]] = {
    "run": ("--steps 3", "--batch-size 2", "--seq-len 64", "--profile unshaped"),
    "sweep": ("--steps 3", "--batch-size 2", "--seq-len 64", "--profiles unshaped"),
    "compare": ("--steps 3", "--batch-size 2", "--seq-len 64", "--profile unshaped"),
    "regime": ("--steps 3", "--batch-size 2", "--seq-len 64"),
}


@dataclass(frozen=True)
class Case:
    args: str  # harness's arguments as a shell would take them; {fx}, {repo} and {cwd} are filled in
    expect: Expect
    literal: str = ""  # output must hold this exactly as typed
    makes: str = ""  # a glob under the case's working folder that must match afterwards
    timeout_s: float = 30.0


def refuse(args: str, literal: str = "") -> Case:
    return Case(args, "refuse", literal=literal)


def notice(args: str) -> Case:
    return Case(args, "notice", timeout_s=240.0)


def work(args: str, literal: str = "", makes: str = "", timeout_s: float = 120.0) -> Case:
    return Case(args, "work", literal=literal, makes=makes, timeout_s=timeout_s)


def warn(args: str) -> Case:
    return Case(args, "warn", timeout_s=240.0)


MARKUP = "[bold]x:warning:"  # rich would drop the tag and turn the code into an emoji
# Kinds of damage to a run folder; each makes a folder of one damaged run (build_fixtures).
DAMAGE = (
    "summary-empty",
    "summary-not-json",
    "summary-list",
    "summary-missing-keys",
    "events-binary",
    "config-missing",
)
CMP = "compare --methods allreduce,dilocox --out {cwd}/cmp"
SWEEP = "--out {cwd}/sweep"

CASES: list[Case] = [
    # run: the profile. Names, missing files, files that are not profiles, a profile the run's shape cannot hold.
    refuse("run --profile nosuch"),
    refuse("run --profile {fx}/nosuch.yaml"),
    refuse("run --profile {fx}/neg-rate.yaml"),
    refuse("run --profile {fx}/not-yaml.yaml"),
    refuse("run --profile straggler-1gbps-one-site-100mbps"),
    refuse(f"run --profile '{MARKUP}'", literal=MARKUP),
    # run: the method. Unknown names, and a method of one's own that cannot be loaded or is not a Method.
    refuse("run --method nosuch"),
    refuse(f"run --method '{MARKUP}'", literal=MARKUP),
    refuse("run --method {fx}/nosuch.py:Foo"),
    refuse("run --method {fx}/syntax.py:Foo"),
    refuse("run --method {fx}/notmethod.py:Foo"),
    refuse("run --method {fx}/notmethod.py:Missing"),
    refuse("run --method {fx}/notmethod.py:helper"),
    refuse("run --method {fx}/notmethod.py"),
    refuse("run --method {fx}/raises.py:Foo"),
    # run: numbers. Zero, negative, past what 64 bits hold, words, fractions, more than the model or host has.
    refuse("run --steps 0"),
    refuse("run --steps abc"),
    refuse("run --steps 1.5"),
    refuse("run --steps 1000000000000000000000000000000"),
    refuse("run --batch-size 0"),
    refuse("run --batch-size -3"),
    refuse("run --batch-size 1000000000"),
    work("run --seq-len 0"),  # documented: 0 is the model's context (--seq-len's help)
    refuse("run --seq-len 100000"),
    refuse("run --eval-every 0"),
    refuse("run --eval-every one"),
    refuse("run --clusters 0"),
    refuse("run --clusters 100000"),
    refuse("run --clusters two"),
    refuse("run --stages 0"),
    refuse("run --stages 64"),
    refuse("run --lr nan"),
    refuse("run --seed 18446744073709551616"),
    refuse("run --throughput-warmup-steps 5"),
    refuse("run --data-shift -1"),
    # run: --set. Unknown keys, malformed assignments, wrong types and ranges, a sweep's list in a single run.
    refuse("run --set nosuch=1"),
    refuse("run --set rank"),
    refuse("run --method dilocox --set rank=abc"),
    refuse("run --method allreduce --set dilocox.rank=32"),
    refuse("run --method allreduce --set rank=32"),
    refuse("run --method dilocox --set overlap=sideways"),
    refuse("run --method dilocox --set exchange=reduce --set compression=false"),
    refuse("run --method dilocox --set local_steps=10,50"),
    refuse("run --local-steps 10"),
    # run: a setting the rest of the configuration makes the method ignore.
    notice("run --method dilocox --set dilocox.reduce_wire=int4"),
    notice("run --method dilocox --set dilocox.bits=8 --set exchange=reduce"),
    notice("run --method dilocox --set power_iterations=3 --set exchange=reduce"),
    notice("run --method dilocox --set overlap_steps=3 --set overlap=none"),
    notice("run --method dilocox --set min_rank=2 --set adaptive=false"),
    # run: a flag the run's shape or backend makes meaningless.
    notice("run --method local --gpus 0"),
    notice("run --method local --pipeline-schedule gpipe"),
    notice("run --method local --data-field body"),
    notice("run --method local --link-emulator netem"),
    # run: --model. Missing, absurd, malformed, unknown types, hub names (never downloaded).
    refuse("run --model {fx}/nosuch-model"),
    refuse("run --model {fx}/absurd"),
    refuse("run --model {fx}/malformed"),
    refuse("run --model {fx}/unknown-type"),
    refuse("run --model {fx}/empty-dir"),
    refuse("run --model gpt2"),
    refuse("run --model '{fx}/nosuch-[bold]m:warning:'", literal="nosuch-[bold]m:warning:"),
    # run: --data. Missing, empty, binary, a folder of nothing, too little text, JSONL without the field.
    refuse("run --data {fx}/nosuch.txt"),
    refuse("run --data {fx}/empty.txt"),
    refuse("run --data {fx}/binary.bin"),
    refuse("run --data {fx}/empty-dir"),
    refuse("run --data {fx}/tiny.txt"),
    refuse("run --data {fx}/no-field.jsonl"),
    refuse("run --data {fx}/junk.parquet"),
    refuse("run --data '{fx}/nosuch-[bold]d:warning:.txt'", literal="nosuch-[bold]d:warning:.txt"),
    # run: --tokenizer. BPE sizes that cannot be, words, missing and malformed tokenizer files.
    refuse("run --tokenizer bpe:-1"),
    refuse("run --tokenizer bpe:10000000000"),
    refuse("run --tokenizer bpe:abc"),
    refuse("run --tokenizer nosuch"),
    refuse("run --tokenizer {fx}/nosuch-tokenizer.json"),
    refuse("run --tokenizer {fx}/bad-tokenizer.json"),
    refuse("run --tokenizer '{fx}/nosuch-[bold]t:warning:.json'", literal="nosuch-[bold]t:warning:.json"),
    # run: --out. An existing file or folder, a place nothing can be written, a path under a file.
    refuse("run --out {fx}/a-file.txt"),
    refuse("run --out {fx}/full-dir"),
    refuse("run --out /proc/nosuch"),
    refuse("run --out {fx}/a-file.txt/nosuch"),
    # run: --fault. Malformed, outside the run, on a rank that does not exist, a rate change on an unshaped link.
    refuse("run --profile 100mbps --fault nonsense"),
    refuse("run --profile 100mbps --fault link-down:2"),
    refuse("run --profile 100mbps --fault link-down:0:3"),
    refuse("run --profile 100mbps --fault link-down:999:1"),
    refuse("run --profile 100mbps --fault kill:2:9"),
    refuse("run --profile 100mbps --fault rate:2:fast"),
    refuse("run --profile unshaped --fault rate:2:100mbit"),
    # run: --config. Missing, empty, malformed, another method's run, a YAML with unknown keys.
    refuse("run --config {fx}/nosuch-run"),
    refuse("run --config {fx}/empty-dir"),
    refuse("run --config {fx}/bad-config-run"),
    refuse("run --config {fx}/good/run --method dilocox"),
    refuse("run --config {fx}/unknown-keys.yaml"),
    # run: the few that train for real (3 steps of the tiny model): warnings a new user should see, and two that
    # work, one of them into a folder whose name rich would read as markup and an emoji code.
    warn("run --method allreduce --clusters 1"),
    warn("run --method dilocox"),
    warn("run --method local --data-shift 10"),
    work("run --method local", makes="results/runs/*", timeout_s=240.0),
    work(f"run --method local --out '{{cwd}}/{MARKUP}'", literal=MARKUP, timeout_s=240.0),
    # sweep: lists that repeat or name nothing, unknown methods and profiles, settings for no method in the sweep.
    refuse(f"sweep --methods allreduce --seeds 0,0 {SWEEP}"),
    refuse(f"sweep --methods allreduce --seeds '' {SWEEP}"),
    refuse(f"sweep --methods allreduce --seeds a,b {SWEEP}"),
    refuse(f"sweep --methods allreduce,nosuch {SWEEP}"),
    refuse(f"sweep --methods allreduce,allreduce {SWEEP}"),
    refuse(f"sweep --methods '{MARKUP}' {SWEEP}", literal=MARKUP),
    refuse(f"sweep --methods allreduce --profiles {{fx}}/nosuch.yaml {SWEEP}"),
    refuse(f"sweep --methods allreduce --profiles 100mbps,nosuch {SWEEP}"),
    refuse("sweep --methods allreduce"),
    refuse("sweep --methods allreduce --out {fx}/a-file.txt"),
    refuse(f"sweep --methods allreduce --repeats 0 {SWEEP}"),
    refuse(f"sweep --methods allreduce --set nosuch=1,2 {SWEEP}"),
    refuse(f"sweep --methods allreduce --regime nosuch {SWEEP}"),
    # A setting scoped to a method or variant the sweep does not run changes nothing: refused or warned about.
    notice(f"sweep --methods allreduce --set dilocox.rank=32 {SWEEP}"),
    notice(f"sweep --methods dilocox@a --set dilocox@b.rank=8 {SWEEP}"),
    # compare: a single site, an existing file as its folder, settings no method takes, flags it does not have.
    refuse(f"{CMP} --clusters 1"),
    refuse("compare --methods allreduce,dilocox --out {fx}/a-file.txt"),
    refuse("compare --methods allreduce,dilocox"),
    refuse("compare --methods allreduce,local --set exchange=reduce --out {cwd}/cmp"),
    refuse(f"{CMP} --exchange reduce"),
    refuse(f"{CMP} --seed 3"),
    refuse(f"{CMP} --composed nosuch"),
    refuse(f"{CMP} --regime nosuch"),
    refuse(f"{CMP} --regime paper-107b --measure-limit 0"),
    refuse(f"{CMP} --method-steps dilocox=abc"),
    refuse("compare --methods allreduce,local --method-steps dilocox=10 --out {cwd}/cmp"),
    refuse(f"{CMP} --target-loss -1"),
    refuse("compare --methods dilocox --out {cwd}/cmp"),
    notice(f"{CMP} --measure-limit 10"),
    notice("compare --methods allreduce,local --set dilocox.exchange=reduce --out {cwd}/cmp"),
    # project: shapes and numbers it cannot model, inputs that are not runs, a replayed link, unused options.
    refuse("project --clusters 0"),
    refuse("project --method nosuch"),
    refuse("project --batch-size 0"),
    refuse("project --compute-s -1"),
    refuse("project --efficiency 1.5"),
    refuse("project --model nosuch"),
    refuse("project --accelerator-tflops 100 --accelerators-per-site 1 --mfu 2"),
    refuse("project --compute-s 0.1 --accelerator-tflops 100 --accelerators-per-site 8 --mfu 0.4"),
    refuse("project --compute-from {fx}/empty-dir"),
    refuse("project --validate {fx}/damaged/summary-list"),
    refuse("project --profile {fx}/site-rates-low-gt-high.yaml"),
    notice("project --profile trace-consumer-uplink"),
    notice("project --compute-s 0.1 --mfu 0.5"),
    notice("project --compute-s 0.1 --csv {cwd}/x.csv"),
    work("project --method dilocox --model tiny --profile 100mbps --compute-s 0.05"),
    # report, plot, check: folders that hold no runs, and folders of damaged runs (built below).
    *(
        case
        for target in ("nosuch", "empty-dir", "a-file.txt", *(f"damaged/{kind}" for kind in DAMAGE))
        for case in (
            refuse(f"report {{fx}}/{target}"),
            refuse(f"plot {{fx}}/{target} --out {{cwd}}/figures"),
            refuse(f"check --baseline {BASELINE} --results {{fx}}/{target} --stored-references"),
        )
    ),
    refuse("report"),
    refuse("report {fx}/good --target-loss -1"),
    refuse("report {fx}/good --csv /proc/nosuch/x.csv"),
    refuse("report {fx}/good --tables {fx}/a-file.txt"),
    refuse("plot {fx}/good --out {fx}/a-file.txt"),
    refuse("check --baseline {fx}/nosuch.yaml --results {fx}/good"),
    refuse("check --baseline {fx}/neg-rate.yaml --results {fx}/good"),
    refuse(f"check --baseline {BASELINE} --results {{fx}}/good --stored-references"),
    refuse(f"check --baseline {BASELINE} --reference-results {{fx}}/good"),
    work("report {fx}/good"),
    work("plot {fx}/good --out {cwd}/figures", makes="figures/*"),
    # profiles show: YAML that is not a profile, values no link can have, traces and drawn rates that cannot be.
    refuse("profiles show {fx}/neg-rate.yaml"),
    refuse("profiles show {fx}/unknown-key.yaml"),
    refuse("profiles show {fx}/rate-fast.yaml"),
    refuse("profiles show {fx}/link-unknown-key.yaml"),
    refuse("profiles show {fx}/neg-delay.yaml"),
    refuse("profiles show {fx}/loss-150.yaml"),
    refuse("profiles show {fx}/jitter-over-delay.yaml"),
    refuse("profiles show {fx}/rate-too-high.yaml"),
    refuse("profiles show {fx}/not-yaml.yaml"),
    refuse("profiles show {fx}/list.yaml"),
    refuse("profiles show {fx}/trace-not-monotonic.yaml"),
    refuse("profiles show {fx}/trace-nosuch-file.yaml"),
    refuse("profiles show {fx}/trace-bad-header.yaml"),
    refuse("profiles show {fx}/trace-with-sites.yaml"),
    refuse("profiles show {fx}/site-rates-low-gt-high.yaml"),
    refuse("profiles show {fx}/site-rates-unknown-distribution.yaml"),
    refuse("profiles show {fx}/sites-bool-key.yaml"),
    refuse("profiles show {fx}/gemodel-p-2.yaml"),
    refuse("profiles show {fx}/bad-tcconfig.json"),
    refuse("profiles show nosuch"),
    refuse("profiles show {fx}/nosuch.yaml"),
    refuse(f"profiles show '{MARKUP}'", literal=MARKUP),
    refuse("profiles show"),
    refuse("profiles export 100mbps --format nosuch"),
    work("profiles show 100mbps"),
    work("profiles list"),
    # methods: unknown names, extra words, a method file that does not load.
    refuse("methods nosuch"),
    refuse(f"methods '{MARKUP}'", literal=MARKUP),
    refuse("methods dilocox allreduce"),
    refuse("methods {fx}/syntax.py:Foo"),
    work("methods --markdown dilocox"),
    work("methods dilocox"),
    work("methods"),
    # reproduce: folders with no finished run in them; a finished one into an existing file.
    refuse("reproduce {fx}/nosuch"),
    refuse("reproduce {fx}/empty-dir"),
    refuse("reproduce {fx}/failed/run"),
    refuse("reproduce {fx}/good"),
    refuse("reproduce {fx}/a-file.txt"),
    refuse("reproduce {fx}/damaged/summary-not-json/run"),
    refuse("reproduce {fx}/good/run --out {fx}/a-file.txt"),
    # cleanup: junk arguments and run keys that cannot be a run's.
    refuse("cleanup junk"),
    refuse("cleanup --run-key nosuch"),
    refuse("cleanup --run-key hx12"),
    refuse(f"cleanup --run-key '{MARKUP}'", literal=MARKUP),
    notice("cleanup --results {fx}/nosuch"),
    refuse("cleanup --results {fx}/a-file.txt"),
    work("cleanup --run-key hx000000 --results {cwd}"),
    # regime: targets that are not published regimes, shapes that cannot be.
    refuse("regime --target nosuch"),
    refuse(f"regime --target '{MARKUP}'", literal=MARKUP),
    refuse("regime --clusters 0"),
    # The rest: unknown commands, stray words, a flag without its value, calibrate and baseline on bad input.
    refuse("nosuch"),
    refuse("run extra-word"),
    refuse("run --steps"),
    refuse("calibrate --profile nosuch"),
    refuse("baseline {fx}/empty-dir"),
    refuse("baseline --diff {fx}/nosuch.yaml {fx}/nosuch.yaml"),
]


# Fixtures: text files by path under the fixture folder. Names with "nosuch" in them are never created.
LLAMA_ABSURD = (
    '{"model_type": "llama", "hidden_size": 65536, "intermediate_size": 262144, "num_hidden_layers": 128, '
    '"num_attention_heads": 512, "num_key_value_heads": 512, "vocab_size": 256000, "max_position_embeddings": 4096}'
)
TEXT_FIXTURES: dict[str, str] = {
    "a-file.txt": "a plain file where a folder is expected\n",
    "full-dir/keep.txt": "a folder that already holds something\n",
    "empty.txt": "",
    "tiny.txt": "hi",
    "no-field.jsonl": '{"body": "text under another field"}\n' * 50,
    "junk.parquet": "PAR1 this is not a parquet file at all",
    "bad-tokenizer.json": '{"version": "1.0", "model": ',
    "unknown-keys.yaml": "foo: 1\nbar: [2, 3]\n",
    "bad-config-run/config.json": '{"method": "allreduce", ',
    "absurd/config.json": LLAMA_ABSURD,
    "malformed/config.json": '{"model_type": "llama", "hidden_size": ',
    "unknown-type/config.json": '{"model_type": "nosuchmodel", "hidden_size": 64}',
    "syntax.py": "class Foo(:\n    pass\n",
    "notmethod.py": "class Foo:\n    pass\n\n\ndef helper():\n    return 1\n",
    "raises.py": "raise RuntimeError('this module fails as it is imported')\n",
    # Profiles that no link can be.
    "neg-rate.yaml": "inter_cluster: {rate: -5mbit}\nintra_cluster: {}\n",
    "unknown-key.yaml": "inter_cluster: {rate: 100mbit}\nintra_cluster: {}\nbandwidth: 5\n",
    "rate-fast.yaml": "inter_cluster: {rate: fast}\nintra_cluster: {}\n",
    "link-unknown-key.yaml": "inter_cluster: {rate: 100mbit, bandwith: 5}\nintra_cluster: {}\n",
    "neg-delay.yaml": "inter_cluster: {rate: 100mbit, delay: -5ms}\nintra_cluster: {}\n",
    "loss-150.yaml": "inter_cluster: {rate: 100mbit, loss: 150%}\nintra_cluster: {}\n",
    "jitter-over-delay.yaml": "inter_cluster: {rate: 100mbit, delay: 5ms, jitter: 20ms}\nintra_cluster: {}\n",
    "rate-too-high.yaml": "inter_cluster: {rate: 100gbit}\nintra_cluster: {}\n",
    "not-yaml.yaml": "inter_cluster: [unclosed\n  rate: 100mbit\n",
    "list.yaml": "- inter_cluster\n- intra_cluster\n",
    "trace-not-monotonic.yaml": "trace: not-monotonic.csv\ninter_cluster: {}\nintra_cluster: {}\n",
    "not-monotonic.csv": "seconds,rate\n0,40mbit\n5,20mbit\n3,30mbit\n",
    "trace-nosuch-file.yaml": "trace: nosuch.csv\ninter_cluster: {}\nintra_cluster: {}\n",
    "trace-bad-header.yaml": "trace: bad-header.csv\ninter_cluster: {}\nintra_cluster: {}\n",
    "bad-header.csv": "time,speed\n0,40mbit\n",
    "trace-with-sites.yaml": "trace: good-trace.csv\ninter_cluster: {}\nintra_cluster: {}\nsites: {1: {rate: 1mbit}}\n",
    "good-trace.csv": "seconds,rate\n0,40mbit\n2,20mbit\n",
    "site-rates-low-gt-high.yaml": "inter_cluster: {rate: 50mbit}\nintra_cluster: {}\n"
    "site_rates: {sites: 4, distribution: uniform, low: 100mbit, high: 10mbit, seed: 0}\n",
    "site-rates-unknown-distribution.yaml": "inter_cluster: {rate: 50mbit}\nintra_cluster: {}\n"
    "site_rates: {sites: 4, distribution: normal, low: 10mbit, high: 100mbit, seed: 0}\n",
    "sites-bool-key.yaml": "inter_cluster: {rate: 50mbit}\nintra_cluster: {}\nsites: {true: {rate: 1mbit}}\n",
    "gemodel-p-2.yaml": "inter_cluster: {rate: 100mbit, loss: {model: gemodel, p: 2}}\nintra_cluster: {}\n",
    "bad-tcconfig.json": '{"eth0": {"outgoing": ',
}


def build_fixtures(fx: Path) -> None:
    """Every input the cases name under {fx}: the text files above, a binary file, empty folders, and runs (one
    good, one failed, and one folder per kind of damage) copied from a committed run."""
    for name, text in TEXT_FIXTURES.items():
        path = fx / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (fx / "binary.bin").write_bytes(bytes(range(256)) * 256)
    (fx / "empty-dir").mkdir()
    if not (TEMPLATE_RUN / "summary.json").is_file():
        raise SystemExit(f"{TEMPLATE_RUN} is not a finished run; this script copies its runs from it")
    shutil.copytree(TEMPLATE_RUN, fx / "good" / "run")
    failed = shutil.copytree(TEMPLATE_RUN, fx / "failed" / "run")
    summary = (failed / "summary.json").read_text()
    (failed / "summary.json").write_text(summary.replace('"status": "ok"', '"status": "failed"', 1))
    for kind in DAMAGE:
        run = shutil.copytree(TEMPLATE_RUN, fx / "damaged" / kind / "run")
        damage(run, kind)


def damage(run: Path, kind: str) -> None:
    summary = run / "summary.json"
    if kind == "summary-empty":
        summary.write_text("")
    elif kind == "summary-not-json":
        summary.write_text("status: ok, but not JSON {")
    elif kind == "summary-list":
        summary.write_text("[1, 2, 3]")
    elif kind == "summary-missing-keys":
        summary.write_text('{"status": "ok"}')
    elif kind == "events-binary":
        (run / "events" / "rank0.jsonl").write_bytes(bytes(range(256)) * 16)
    elif kind == "config-missing":
        (run / "config.json").unlink()
    else:
        raise ValueError(f"no such damage: {kind}")


def fill(args: str, places: dict[str, str]) -> list[str]:
    """The case's argument words, its {names} filled in and the bounds of a training command added."""
    for name, value in places.items():
        args = args.replace("{" + name + "}", value)
    words = shlex.split(args)
    bounds = [
        part
        for bound in (BOUNDS.get(words[0], ()) if words else ())
        if not any(word == bound.split()[0] or word.startswith(bound.split()[0] + "=") for word in words)
        for part in bound.split()
    ]
    # Right after the command, so the case's own words (a flag left without its value) still end the line.
    return [*words[:1], *bounds, *words[1:]]


def _lines(command: list[str]) -> list[str]:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return done.stdout.splitlines()


def _under(root: Path, depth: int | None = None) -> set[str]:
    if not root.is_dir():
        return set()
    if depth is None:
        return {f"file {path}" for path in root.rglob("*")}
    return {f"file {path}" for level in range(1, depth + 1) for path in root.glob("/".join(["*"] * level))}


def host_state(workdir: Path) -> set[str]:
    """What a refusal must not add to: the host's network namespaces and links, run locks, the harness's temp
    folders, the corpus cache, and every file under this round's temp folder (results/ of every case)."""
    state = {f"netns {line.split()[0]}" for line in _lines(["ip", "netns", "list"]) if line.strip()}
    for line in _lines(["ip", "-o", "link"]):
        parts = line.split()
        if len(parts) > 1:
            state.add(f"link {parts[1].rstrip(':').split('@')[0]}")
    cache = Path(os.environ.get("HARNESS_CACHE_DIR") or Path.home() / ".cache" / "harness")
    state |= _under(cache, depth=3)
    state |= _under(Path("/run/harness"), depth=1)
    temp = Path(tempfile.gettempdir())
    state |= {f"file {path}" for path in temp.glob("harness*")}
    state |= _under(workdir)
    return state


@dataclass
class Result:
    returncode: int | None  # None: killed at its timeout
    output: str  # stderr, then stdout
    seconds: float
    new: list[str]  # what appeared on the host while it ran
    cwd: Path
    fx: Path


def execute(harness: Path, case: Case, number: int, fx: Path, workdir: Path) -> Result:
    cwd = workdir / "cases" / f"{number:03d}"
    cwd.mkdir(parents=True)
    argv = [str(harness), *fill(case.args, {"fx": str(fx), "repo": str(ROOT), "cwd": str(cwd)})]
    before = host_state(workdir)
    start = time.monotonic()
    # A session of its own: the timeout then stops this command and everything it started, and nothing else.
    proc = subprocess.Popen(
        argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    returncode: int | None
    try:
        out, err = proc.communicate(timeout=case.timeout_s)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        out, err = stop(proc)
        returncode = None
    except BaseException:
        # Ctrl-C reaches this script only (the case has a session of its own): stop the case before leaving.
        stop(proc)
        raise
    seconds = time.monotonic() - start
    new = sorted(host_state(workdir) - before)
    text = err.decode(errors="replace") + out.decode(errors="replace")
    return Result(returncode, text, seconds, new, cwd, fx)


def stop(proc: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
    """SIGTERM to the case's process group (the harness removes what it built), SIGKILL for what is left."""
    for sig, grace in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    try:
        return proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        return b"", b"(output lost: a process outside the group held the pipes)"


def refusal_problems(result: Result) -> list[str]:
    problems = []
    lines = [line for line in result.output.splitlines() if line.strip()]
    if result.returncode == 0:
        problems.append("accepted (exit 0)")
    if not any(line.startswith("error:") for line in lines):
        problems.append("no 'error:' line")
    chars = sum(len(line) for line in lines)
    if len(lines) > REFUSAL_LINES or chars > REFUSAL_CHARS:
        problems.append(f"{len(lines)} lines, {chars} chars of output")
    if result.seconds > REFUSAL_SECONDS:
        problems.append(f"took {result.seconds:.1f} s")
    if result.new:
        shown = ", ".join(item.replace(str(result.cwd), ".").replace(str(result.fx), "{fx}") for item in result.new[:3])
        problems.append(f"left {len(result.new)} new thing(s) on the host: {shown}")
    return problems


def judge(case: Case, result: Result) -> list[str]:
    """What keeps the case from holding; [] when it holds."""
    lines = result.output.splitlines()
    warned = any(line.startswith("warning:") for line in lines)
    problems = []
    if result.returncode is None:
        problems.append(f"still running after {case.timeout_s:.0f} s")
    if "Traceback" in result.output:
        problems.append("traceback")
    if case.literal and case.literal not in result.output:
        problems.append(f"{case.literal!r} not printed as typed")
    if case.makes and not any(result.cwd.glob(case.makes)):
        problems.append(f"no {case.makes}")
    if case.expect == "refuse" or (case.expect == "notice" and result.returncode != 0):
        problems += refusal_problems(result)
    elif case.expect == "notice" and not warned:
        problems.append("silently accepted (exit 0, no warning)")
    elif case.expect in ("warn", "work") and result.returncode not in (0, None):
        problems.append(f"exit {result.returncode}")
    if case.expect == "warn" and not warned:
        problems.append("no 'warning:' line")
    return problems


def got(result: Result) -> str:
    if result.returncode is None:
        return f"killed at {result.seconds:.0f} s"
    warned = any(line.startswith("warning:") for line in result.output.splitlines())
    return f"exit {result.returncode}{', warned' if warned else ''}, {result.seconds:.1f} s"


def first_line(result: Result) -> str:
    lines = [line.strip() for line in result.output.splitlines() if line.strip()]
    line = next((x for x in lines if x.startswith(("error:", "warning:"))), lines[0] if lines else "(nothing)")
    # The case's own folders as the catalogue names them: the temp paths would fill the column.
    line = line.replace(str(result.cwd), "{cwd}").replace(str(result.fx), "{fx}")
    return line if len(line) <= 140 else line[:137] + "..."


def cell(text: str) -> str:
    """Text as one markdown table cell: pipes escaped, backticks kept from closing the code span."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("`", "'")


def row(number: int, case: Case, result: Result, problems: list[str]) -> str:
    command = case.args if len(case.args) <= 90 else case.args[:87] + "..."
    verdict = "holds" if not problems else "FAILS: " + "; ".join(problems)
    output = cell(first_line(result))
    cells = [str(number), f"`harness {cell(command)}`", case.expect, got(result), cell(verdict), output]
    return "| " + " | ".join(cells) + " |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--harness", type=Path, default=Path(".venv/bin/harness"), help="relative to the repo root")
    parser.add_argument("--out", type=Path, help="also write the table here")
    parser.add_argument("--only", metavar="PATTERN", help="run the cases whose arguments match this regex")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder (fixtures and case folders)")
    parser.add_argument("--list", action="store_true", help="print the chosen cases and run none")
    args = parser.parse_args()
    harness = args.harness if args.harness.is_absolute() else ROOT / args.harness
    if not os.access(harness, os.X_OK):
        parser.error(f"{harness} is not an executable; pass --harness PATH")
    chosen = [(n, case) for n, case in enumerate(CASES, 1) if not args.only or re.search(args.only, case.args)]
    if not chosen:
        parser.error(f"no case matches {args.only!r}")
    if args.list:
        for number, case in chosen:
            print(f"{number:3d} {case.expect:7s} harness {case.args}")
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="hostile-inputs-"))
    rows = [
        "| # | command | expected | got | verdict | first line of output |",
        "|--:|---|---|---|---|---|",
    ]
    held = 0
    try:
        fx = workdir / "fixtures"
        build_fixtures(fx)
        for number, case in chosen:
            result = execute(harness, case, number, fx, workdir)
            problems = judge(case, result)
            held += not problems
            rows.append(row(number, case, result, problems))
            mark = "ok  " if not problems else "FAIL"
            print(f"{mark} {number:3d} harness {case.args}  ({got(result)})", file=sys.stderr, flush=True)
    finally:
        if args.keep:
            print(f"kept {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    table = "\n".join([*rows, "", f"{held} of {len(chosen)} hold"]) + "\n"
    print(table, end="")
    if args.out:
        args.out.write_text(table)
    return 0 if held == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
