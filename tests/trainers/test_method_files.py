"""A method from a file outside the repository (trainers/registry.py's register_file): what registers, under which
name, and the one sentence naming the file for each way a plugin can be broken."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.errors import UserError
from harness.run.config import RunConfig, resolve_method
from harness.run.settings import resolve_entries
from trainers import registry
from trainers.registry import PluginError, is_file_spec, register_file

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "local_int8.py"

GOOD = """
from dataclasses import dataclass, field
from trainers.method import Method, MethodConfig

@dataclass(frozen=True)
class EveryConfig(MethodConfig):
    local_steps: int = field(default=4, metadata={"help": "Steps between averages."})

class Every(Method):
    config_class = EveryConfig
    def step(self, step):
        self.inner.step()
"""


@pytest.fixture(autouse=True)
def registry_as_it_was():
    before = dict(registry.METHODS)
    yield
    registry.METHODS.clear()
    registry.METHODS.update(before)


def _plugin(tmp_path: Path, source: str, name: str = "plugin.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def test_a_file_registers_under_the_class_name_and_runs_record_where_it_came_from(tmp_path):
    path = _plugin(tmp_path, GOOD)
    assert register_file(f"{path}:Every") == "every"
    assert registry.method_class("every").__name__ == "Every"
    assert registry.option_names("every") == {"local_steps"}
    config = RunConfig.build("every", "1gbps", steps=10)
    assert config.method_source == f"{path}:Every" and config.run_id.split("-")[1] == "every"
    assert registry.method_source("allreduce") == ""


def test_the_example_registers_under_its_name_attribute_and_sets_its_settings():
    name = resolve_method(f"{EXAMPLE}:LocalInt8")
    assert name == "localint8"
    config = RunConfig.build(name, "1gbps", steps=10, local_steps=5)
    assert config.method_config.local_steps == 5
    assert resolve_entries([f"{EXAMPLE}:LocalInt8@fast", "allreduce"]) == ["localint8@fast", "allreduce"]


def test_a_config_read_back_registers_its_file_again(tmp_path):
    path = _plugin(tmp_path, GOOD)
    config = RunConfig.build(resolve_method(f"{path}:Every"), "1gbps", steps=10)
    config.save(tmp_path / "config.json")
    registry.METHODS.pop("every")
    again = RunConfig.load(tmp_path / "config.json")
    assert again.method == "every" and registry.method_class("every").__name__ == "Every"


def test_a_renamed_class_does_not_pass_for_the_run_it_made(tmp_path):
    path = _plugin(tmp_path, GOOD)
    with pytest.raises(PluginError, match="is now named 'every', not 'other'"):
        register_file(f"{path}:Every", expected_name="other")


def test_file_specs_are_told_from_names_and_variants():
    assert is_file_spec("my/method.py:Every") and not is_file_spec("dilocox")
    assert not is_file_spec("my/method.py:Every@paper") and not is_file_spec("my/method.py")


BROKEN = [
    ("nothing.py:Every", None, "does not exist; pass path/to/file.py:ClassName"),
    ("plugin.py:Every", "import no_such_module_here\n", "failed to import: ModuleNotFoundError"),
    ("plugin.py:Missing", GOOD, "has no class Missing; it defines: Every, EveryConfig"),
    ("plugin.py:Every", "class Every:\n    pass\n", "Every is not a subclass of trainers.method.Method"),
    (
        "plugin.py:Every",
        "from trainers.method import Method\nclass Every(Method):\n    config_class = dict\n"
        "    def step(self, s): pass\n",
        "config_class must be a dataclass subclassing trainers.method.MethodConfig",
    ),
    ("plugin.py:Every", GOOD.replace("    def step(self, step):\n        self.inner.step()\n", "    pass\n"),
     "does not implement step"),
    ("plugin.py:Every", GOOD.replace("local_steps: int = field(default=4, ", "local_steps: int = field("),
     "field local_steps has no default"),
    ("plugin.py:Every", GOOD.replace("config_class = EveryConfig", 'config_class = EveryConfig\n    name = "Bad-Name"'),
     "method name 'Bad-Name' must be 1-32 lower-case letters"),
    ("plugin.py:Every", GOOD.replace("config_class = EveryConfig", 'config_class = EveryConfig\n    name = "dilocox"'),
     "name 'dilocox' is a built-in method's"),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "source", "words"), BROKEN, ids=[w.split(";")[0][:40] for _, _, w in BROKEN])
def test_a_broken_plugin_is_one_sentence_naming_its_file(tmp_path, spec, source, words):
    if source is not None:
        _plugin(tmp_path, source)
    with pytest.raises(UserError) as caught:
        resolve_method(f"{tmp_path}/{spec}")
    message = str(caught.value)
    assert words in message and "\n" not in message
    assert str(tmp_path) in message or "nothing.py" in message


def test_a_field_of_another_type_than_a_built_ins_is_named_with_its_file(tmp_path):
    path = _plugin(tmp_path, GOOD.replace("local_steps: int = field(default=4", 'local_steps: str = field(default="4"'))
    register_file(f"{path}:Every")
    with pytest.raises(PluginError, match=rf"{path}:Every: method option local_steps has type"):
        registry.method_options()


def test_two_files_cannot_take_one_name(tmp_path):
    first, second = _plugin(tmp_path, GOOD, "a.py"), _plugin(tmp_path, GOOD, "b.py")
    register_file(f"{first}:Every")
    with pytest.raises(PluginError, match=rf"name 'every' is that of {first}:Every"):
        register_file(f"{second}:Every")


def _installed_package(root: Path, entry: str) -> dict[str, str]:
    """A package on PYTHONPATH whose metadata declares `entry` under harness.methods, as pip would install it."""
    (root / "toy_methods.py").write_text(textwrap.dedent(GOOD))
    info = root / "toy_methods-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-methods\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[harness.methods]\n{entry}\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}


def test_an_installed_packages_entry_point_is_a_method_of_every_command(tmp_path):
    env = _installed_package(tmp_path, "every = toy_methods:Every")
    listed = subprocess.run([sys.executable, "-m", "harness.cli", "methods"], env=env, capture_output=True, text=True)
    assert listed.returncode == 0 and "every" in listed.stdout.split(), listed.stdout + listed.stderr
    projected = subprocess.run(
        [sys.executable, "-m", "harness.cli", "project", "--method", "every", "--compute-s", "0.05"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    # Found by its entry point; it declares no sync plan, so the projection refuses it by name.
    assert projected.returncode == 2 and "not 'every', which declares none" in projected.stderr, projected.stderr


def test_an_entry_point_with_a_built_in_name_is_refused(tmp_path):
    env = _installed_package(tmp_path, "dilocox = toy_methods:Every")
    listed = subprocess.run([sys.executable, "-m", "harness.cli", "methods"], env=env, capture_output=True, text=True)
    assert listed.returncode != 0
    assert "entry point named 'dilocox', a built-in method's name; rename its entry point" in listed.stderr


def test_containers_cannot_load_a_method_from_a_file_on_this_host(tmp_path):
    path = _plugin(tmp_path, GOOD)
    config = RunConfig.build(resolve_method(f"{path}:Every"), "1gbps", steps=10, backend="docker")
    with pytest.raises(UserError, match="the docker backend's ranks do not see this host's files"):
        config.validate()
