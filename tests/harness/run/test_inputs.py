"""config.json's inputs: the absolute path and content hash of each file a run reads from outside the repository."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from harness.run.config import RunConfig


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_relative_paths_are_recorded_absolute_and_names_unchanged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("corpus.txt").write_text("some text\n" * 200)
    Path("tok.json").write_text("{}")
    config = RunConfig.build("allreduce", "unshaped", data="corpus.txt", tokenizer="tok.json", model="tiny")
    assert config.train.data == str(tmp_path / "corpus.txt")
    assert config.train.tokenizer == str(tmp_path / "tok.json")
    assert config.train.model == "tiny"
    assert RunConfig.build("allreduce", "unshaped", tokenizer="bpe:512").train.tokenizer == "bpe:512"


def test_a_path_that_does_not_exist_is_left_as_given_for_validation_to_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert RunConfig.build("allreduce", "unshaped", data="missing.txt").train.data == "missing.txt"


def test_a_bare_name_that_is_also_a_file_here_stays_the_built_in_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("tiny").mkdir()
    assert RunConfig.build("allreduce", "unshaped", model="tiny").train.model == "tiny"


def test_config_json_holds_the_hash_of_each_input_and_loads_back(tmp_path):
    text = b"def f(x):\n    return x + 1\n" * 100
    (tmp_path / "corpus.txt").write_bytes(text)
    tokenizer = b'{"not": "read here"}'
    (tmp_path / "tok.json").write_bytes(tokenizer)
    config = RunConfig.build(
        "allreduce", "unshaped", data=str(tmp_path / "corpus.txt"), tokenizer=str(tmp_path / "tok.json")
    )
    config.save(tmp_path / "config.json")
    inputs = json.loads((tmp_path / "config.json").read_text())["inputs"]
    # One text file is one document: the corpus hash is the file's bytes' hash.
    assert inputs["data"] == {
        "path": str(tmp_path / "corpus.txt"),
        "sha256": _sha256(text),
        "hash_of": inputs["data"]["hash_of"],
    }
    assert inputs["tokenizer"] == {"path": str(tmp_path / "tok.json"), "sha256": _sha256(tokenizer)}
    assert "model_config" not in inputs
    assert RunConfig.load(tmp_path / "config.json").train == config.train


def test_a_changed_data_file_changes_its_recorded_hash(tmp_path):
    corpus = tmp_path / "corpus.txt"
    hashes = []
    for text in ("first version\n" * 100, "second version\n" * 100):
        corpus.write_text(text)
        RunConfig.build("allreduce", "unshaped", data=str(corpus)).save(tmp_path / "config.json")
        hashes.append(json.loads((tmp_path / "config.json").read_text())["inputs"]["data"]["sha256"])
    assert hashes[0] != hashes[1]


def test_a_transformers_config_and_its_checkpoint_are_hashed(tmp_path, monkeypatch):
    from tests.trainers.hf_configs import small

    folder = small("opt", tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"weights")
    monkeypatch.chdir(tmp_path)
    config = RunConfig.build("allreduce", "unshaped", model="m")
    assert config.train.model == str(folder)
    config.save(tmp_path / "config.json")
    inputs = json.loads((tmp_path / "config.json").read_text())["inputs"]
    assert inputs["model_config"] == {
        "path": str(folder / "config.json"),
        "sha256": _sha256((folder / "config.json").read_bytes()),
    }
    assert inputs["model_checkpoint"]["sha256"] == _sha256(b"weights")


def test_rerunning_a_run_whose_data_changed_since_is_refused_unless_the_data_is_named_again(tmp_path):
    from click.testing import CliRunner

    from harness import cli

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the text the run read\n" * 200)
    run = tmp_path / "run"
    run.mkdir()
    RunConfig.build("allreduce", "unshaped", data=str(corpus)).save(run / "config.json")
    corpus.write_text("other text written since\n" * 200)

    refused = CliRunner().invoke(cli.main, ["run", "--config", str(run), "--out", str(tmp_path / "again")])
    assert refused.exit_code != 0
    assert f"{corpus} has changed since the run in {run} read it" in refused.output
    assert not (tmp_path / "again").exists()
    # Named again, the file is taken as it is now: the check is passed and the next one (a bad cluster count) speaks.
    named = CliRunner().invoke(
        cli.main, ["run", "--config", str(run), "--data", str(corpus), "--clusters", "0", "--out", str(tmp_path / "x")]
    )
    assert named.exit_code != 0 and "has changed" not in named.output and "clusters" in named.output
