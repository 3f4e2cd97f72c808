"""`--set [METHOD.]KEY=VALUE`: the one form in which every command (run, sweep, compare, project, regime) takes a
method's settings and the training settings that have no flag of their own.

A method's settings are the fields of its config dataclass (each documented where it is declared; `harness methods
NAME` lists them), so they live in the method's own namespace: `--set dilocox.rank=64` names DiLoCoX's rank
whatever other methods call their settings, and `--set rank=64` means the same wherever only one method can take it
(`harness run`, or a sweep in which only DiLoCoX has a rank). A key without a method goes to every method that has
it, and a training or cluster key (`threads_per_rank`, `steps`, `clusters`, ...) to every run. In a sweep a key
without a method may take several values, `--set local_steps=10,50`, and the sweep runs each; a key scoped to one
method (or one variant, `dilocox@paper.overlap=delayed`) takes one value.

Why one repeatable flag rather than a flag per setting (`--rank`, torchtitan's `--training.steps`): 34 method
settings as flags made `harness run --help` 59 options long and forced settings of different methods to dodge each
other's names; with --set the help lists the run's own options, `harness methods` the settings, and the same text
works in every command and in a stored study command.

The flags of before (`--local-steps 10`, `--no-final-sync`, `--method-set dilocox:rank=32`) are refused with one
sentence naming the new form (`old_flag_message`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from harness.errors import UserError
from trainers.config import TrainConfig, format_value

SCOPE_MARK = "."
VARIANT_MARK = "@"
CLUSTER_KEYS = frozenset({"clusters", "stages", "backend", "link_emulator"})
# The seed is a sweep axis of its own (--seeds) and a flag of `harness run`; of the optimizer, runs take the
# learning rate.
TRAIN_KEYS = frozenset(f.name for f in dataclasses.fields(TrainConfig)) - {"optim", "seed"} | {"lr"}
# How a run is kept, not what it trains: a sweep's or compare's runs checkpoint with --set checkpoint_every=N, so an
# interrupted one resumes inside itself (harness/analysis/experiments/sweep.py).
KEEPING_KEYS = frozenset({"checkpoint_every"})
# Fault tolerance, `--set fault_tolerance=torchft`, and its settings (harness/run/fault_tolerance.py documents them).
FAULT_TOLERANCE_KEYS = frozenset(
    {"fault_tolerance", "min_replicas", "restart_delay_s", "replica_timeout_s", "mtbf_s", "failure_seed"}
)
RUN_KEYS = CLUSTER_KEYS | TRAIN_KEYS | KEEPING_KEYS | FAULT_TOLERANCE_KEYS
SET_METAVAR = "[METHOD.]KEY=VALUE"


class SettingError(UserError):
    """A --set that cannot be read or names nothing the run has; the message names the fix."""


class Assignment(NamedTuple):
    """One --set: `scope` is the method (or METHOD@LABEL variant) it is for, None for every run that has `key`."""

    scope: str | None
    key: str
    values: tuple[Any, ...]

    @property
    def text(self) -> str:
        scope = f"{self.scope}{SCOPE_MARK}" if self.scope else ""
        return f"{scope}{self.key}={','.join(format_value(v) for v in self.values)}"


def parse_value(text: str) -> Any:
    """'10' -> 10, '1e-3' -> 0.001, 'true' -> True; anything else, 'none' included, stays a string (the method's
    config reads 'none' as switching an optional setting off, and checks every value against the field's type)."""
    text = text.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_assignment(text: str) -> Assignment:
    """'dilocox.local_steps=10' -> ('dilocox', 'local_steps', (10,)); 'local_steps=10,50' -> (None, ..., (10, 50)).
    Dashes in the key read as underscores."""
    target, equals, values = text.partition("=")
    scope, dot, key = target.strip().rpartition(SCOPE_MARK)
    key = key.strip().replace("-", "_")
    if not (equals and key and values.strip()) or (dot and not scope.strip()):
        raise SettingError(f"--set {text!r} must look like {SET_METAVAR} (e.g. dilocox.local_steps=10)")
    return Assignment(scope.strip() or None, key, tuple(parse_value(v) for v in values.split(",")))


def parse_assignments(texts: Iterable[str]) -> list[Assignment]:
    return [parse_assignment(text) for text in texts]


def resolve_entries(entries: Sequence[str]) -> list[str]:
    """--methods entries (METHOD or METHOD@LABEL) with each METHOD given as path/to/file.py:Class registered and
    replaced by its name (harness/run/config.py's resolve_method); raises UserError naming the file."""
    from harness.run.config import resolve_method
    from trainers.registry import is_file_spec

    resolved = []
    for entry in entries:
        plain = is_file_spec(entry) or VARIANT_MARK not in entry
        method, mark, label = (entry, "", "") if plain else entry.rpartition(VARIANT_MARK)
        resolved.append(resolve_method(method) + mark + label)
    return resolved


def method_of(entry: str) -> str:
    """'dilocox@paper' -> 'dilocox'."""
    return entry.partition(VARIANT_MARK)[0]


def method_setting_names(method: str) -> frozenset[str]:
    from trainers.registry import option_names

    return option_names(method)


def _unknown_key(key: str, method: str) -> SettingError:
    return SettingError(
        f"{method} has no setting {key!r} and no run takes it; `harness methods {method}` lists {method}'s settings "
        "(training and cluster settings: steps, batch_size, threads_per_rank, ... as in `harness run --help`)"
    )


def run_settings(method: str, assignments: Sequence[Assignment]) -> dict[str, Any]:
    """The settings of one run of `method` (RunConfig.build's flat keys) from its --set assignments: each one value,
    scoped to this method or to none, naming a setting of the method or of every run."""
    settings: dict[str, Any] = {}
    for assignment in assignments:
        if assignment.scope is not None and assignment.scope != method:
            raise SettingError(
                f"--set {assignment.text} is for {assignment.scope}, and this run is of {method}; write --set "
                f"{method}.{assignment.key}=... or leave out the method"
            )
        if len(assignment.values) != 1:
            raise SettingError(f"--set {assignment.text} gives several values; one run takes one (a sweep takes many)")
        if assignment.key not in RUN_KEYS and assignment.key not in method_setting_names(method):
            raise _unknown_key(assignment.key, method)
        settings[assignment.key] = assignment.values[0]
    return settings


def old_flag_message(flag: str, value: str | None = None) -> str | None:
    """The sentence that refuses a flag of before --set (`flag`, with the `value` that followed it), naming its new
    form; None for any other flag."""
    from trainers.registry import method_options

    name, equals, inline = flag.partition("=")
    given = inline if equals else value
    if name == "--method-set":
        method, _, assignment = (given or "METHOD:KEY=VALUE").partition(":")
        return f"--method-set is now --set METHOD.KEY=VALUE: write --set {method}.{assignment}"
    options = method_options()
    key = name.removeprefix("--").replace("-", "_")
    if key in options:
        new = f"--set {key}=" + ("true" if options[key].kind is bool else given or "VALUE")
    elif key.startswith("no_") and key[3:] in options:
        key = key[3:]
        new = f"--set {key}=" + ("false" if options[key].kind is bool else "none")
    else:
        return None
    owners = ", ".join(options[key].defaults)
    return f"{name} is now a setting of {owners}: write {new} (`harness methods` lists every method's settings)"


def takes_value(flag: str) -> bool:
    """Whether an old method flag read the next word as its value (a switch, --no-X or --X=V did not)."""
    from trainers.registry import method_options

    name, equals, _ = flag.partition("=")
    option = method_options().get(name.removeprefix("--").replace("-", "_"))
    return not equals and option is not None and option.kind is not bool


class SettingDoc(NamedTuple):
    """One setting of a method, as `harness methods` and docs/methods.md show it."""

    name: str
    kind: str  # its type, as a reader writes it: int, float, bool, int or none, one of a|b
    default: str  # as --set would give it; a default derived from other settings says so
    help: str  # the field's doc, where it is declared (its metadata["help"])


def _kind_text(kind: Any) -> str:
    import types
    import typing

    if typing.get_origin(kind) is typing.Literal:
        return "|".join(map(str, typing.get_args(kind)))
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        inner = [k for k in typing.get_args(kind) if k is not type(None)]
        return " or ".join([*(_kind_text(k) for k in inner), "none"])
    return getattr(kind, "__name__", str(kind))


def method_settings(method: str) -> list[SettingDoc]:
    """Every setting of `method`, in declaration order: its type, default and doc (from its config dataclass)."""
    import typing

    from trainers.registry import method_class

    config_class = method_class(method).config_class
    hints = typing.get_type_hints(config_class)
    return [
        SettingDoc(f.name, _kind_text(hints[f.name]), format_value(f.default), f.metadata.get("help", ""))
        for f in dataclasses.fields(config_class)
    ]


def settings_markdown(methods: Sequence[str]) -> str:
    """docs/methods.md's settings section: one table per method, from its config (a test holds the page to it)."""
    parts = []
    for method in methods:
        rows = method_settings(method)
        parts.append(f"### `{method}`\n")
        if not rows:
            parts.append("No settings.\n")
            continue
        lines = ["| setting | type | default | what it is |", "|:--|:--|:--|:--|"]
        lines += [
            f"| `{r.name}` | {r.kind.replace('|', ' / ')} | `{r.default}` | {r.help.replace('|', '/')} |" for r in rows
        ]
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


# Keys of a config.json that describe the run that was, not a setting of the next one.
RECORD_ONLY_KEYS = frozenset(
    {"run_id", "run_key", "collective_timeout_s", "method_options_given", "calibrate", "inputs", "method_source"}
)
FILE_RUN_KEYS = (
    "clusters", "stages", "backend", "gpus", "link_emulator", "faults", "tensorboard", "wandb", "checkpoint_every",
    "fault_tolerance",
)  # fmt: skip


class FileSettings(NamedTuple):
    method: str
    profile: Any  # a profile name or path, or a Profile (a config.json records the whole profile)
    settings: dict[str, Any]  # RunConfig.build's flat settings
    inputs: dict[str, Any] = {}  # a config.json's record of the files it read (harness/run/inputs.py)


def settings_from_file(path: Any) -> FileSettings:
    """The run a config file describes: a run folder's config.json (or the folder), or a YAML with its keys
    (method, profile, clusters, ..., train: {steps, ...}, method_options: {...}). A config.json's method_options
    are the resolved ones, every field with the value it had, so a rerun is that variant whatever today's defaults;
    a key that no run takes is refused by name."""
    from pathlib import Path

    import yaml

    from harness.net.link import Profile
    from trainers.config import OptimConfig
    from trainers.registry import applicable_options

    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        data = yaml.safe_load(file.read_text())
    except OSError as err:
        raise SettingError(
            f"cannot read the config {file} ({err.strerror or err}); give a run folder's config.json or a YAML"
        ) from None
    except yaml.YAMLError as err:
        # The parser's own message spans lines (a caret under the text): its position is what a user needs.
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SettingError(
            f"the config {file} is not valid JSON or YAML{where}; give a run folder's config.json or a YAML"
        ) from None
    if not isinstance(data, dict) or "method" not in data or "profile" not in data:
        raise SettingError(f"{file} is no run config: it needs at least method: and profile: (as a config.json has)")
    if data.get("mode", "train") != "train":
        raise SettingError(f"{file} is the config of a {data['mode']} run; `harness {data['mode']}` makes those")
    known = {"method", "profile", "train", "method_options", "mode", *FILE_RUN_KEYS, *RECORD_ONLY_KEYS}
    unknown = sorted(set(data) - known)
    if unknown:
        raise SettingError(f"{file} has key(s) no run takes: {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    settings = {k: data[k] for k in FILE_RUN_KEYS if k in data}
    if "faults" in settings:
        settings["faults"] = tuple(settings["faults"])
    if isinstance(settings.get("fault_tolerance"), dict):
        # A config.json records FaultTolerance whole; RunConfig.build takes its fields flat, as the CLI gives them.
        recorded = settings.pop("fault_tolerance")
        settings["fault_tolerance"] = recorded.pop("engine", "none")
        settings.update(recorded)
    train = dict(data.get("train") or {})
    optim = dict(train.pop("optim", None) or {})
    if "lr" in optim:
        settings["lr"] = optim.pop("lr")
    defaults = dataclasses.asdict(OptimConfig())
    fixed = sorted(
        k for k, v in optim.items() if k not in defaults or list(_as_tuple(v)) != list(_as_tuple(defaults[k]))
    )
    if fixed:
        raise SettingError(
            f"{file} sets the optimizer's {', '.join(fixed)}, which only the code's defaults set (a run of older "
            "code?); remove them from the file to run with today's"
        )
    settings.update(train)
    method = _method_of(data, file)
    settings.update(applicable_options(method, data.get("method_options") or {}))
    profile = data["profile"]
    return FileSettings(
        method,
        Profile.from_dict(profile) if isinstance(profile, dict) else profile,
        settings,
        data.get("inputs") or {},
    )


def _method_of(data: dict[str, Any], file: Any) -> str:
    """The config's method, its file registered where it came from one (a config.json's method_source, or a YAML's
    method: path/to/file.py:Class); raises SettingError naming the file."""
    from trainers.registry import PluginError, is_file_spec, register_file

    method, source = str(data["method"]), data.get("method_source") or ""
    try:
        if is_file_spec(method):
            return register_file(method)
        if is_file_spec(source):
            register_file(source, expected_name=method)
    except PluginError as err:
        raise SettingError(f"{file}: {err}") from None
    return method


def _as_tuple(value: Any) -> tuple:
    """A value as a tuple, lists and tuples alike (JSON has no tuples): betas compare equal either way."""
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)
