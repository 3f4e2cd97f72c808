"""A run's full configuration: the cluster around the training, plus the training itself.

Defaults live in the dataclasses (here and in trainers/config.py and each method's config); the CLI passes only
what the user set.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from harness.backends import capabilities
from harness.errors import UserError
from harness.net.link import Profile
from harness.net.profiles import check_shapeable, load_profile
from harness.net.topology import Topology
from harness.net.trace import replays_rate
from harness.process import run_interruptibly
from harness.run.fault_tolerance import FaultTolerance, check_fault_tolerance
from harness.run.faults import Fault, check_faults, parse_fault
from harness.run.inputs import absolute_paths, input_record
from harness.run.memory import (
    available_bytes,
    check_batch_fits,
    check_fits,
    check_parameters_fit,
    parameters_at_least,
)
from trainers.config import OptimConfig, TrainConfig
from trainers.registry import is_file_spec
from trainers.tokenizer import BYTES

if TYPE_CHECKING:
    from trainers.method import MethodConfig

# Fewer synchronizations than this and a DiLoCo-style run is mostly local training: warned before it starts.
MIN_SYNCS = 3
# Fewer evaluations than this (the one before training included) and the loss curve, and the time a method takes
# to reach a target loss read from it, rest on a few points: warned before it starts. The defaults make 5. Runs
# shorter than MIN_CURVE_STEPS are smoke tests whose curve nobody reads.
MIN_EVALUATIONS = 5
MIN_CURVE_STEPS = 100


def new_run_key() -> str:
    return "hx" + secrets.token_hex(3)


def default_collective_timeout_s() -> float:
    """300 s, or HARNESS_TIMEOUT_S: long enough for one all-reduce on the slowest link a sweep uses."""
    text = os.environ.get("HARNESS_TIMEOUT_S", "300")
    try:
        timeout_s = float(text)
    except ValueError:
        timeout_s = math.nan
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise UserError(
            f"HARNESS_TIMEOUT_S={text!r} is not a positive number of seconds; set it to e.g. 600 or unset it"
        )
    return timeout_s


def check_method_options(method: str, options: dict[str, Any]) -> MethodConfig:
    """The config of a known method from options it has with values it accepts; raises UserError."""
    from trainers.registry import method_config

    try:
        return method_config(method, options)
    except (ValueError, TypeError) as err:
        raise UserError(str(err)) from None


def check_finite_options(options: dict[str, Any]) -> None:
    """No method option is nan or infinite (click's FLOAT reads "nan" and "inf"); raises UserError."""
    for name, value in options.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"--{name.replace('_', '-')} must be a finite number, got {value}")


LINK_EMULATORS = ("auto", "netem", "userspace")


def resolve_method(text: str) -> str:
    """The method `text` names: a registered name as it is, or path/to/file.py:Class registered from its file
    (trainers/registry.py) under the name it gives; raises UserError naming the file."""
    from trainers.registry import PluginError, is_file_spec, register_file

    try:
        return register_file(text) if is_file_spec(text) else text
    except PluginError as err:
        raise UserError(str(err)) from None


@dataclass
class RunConfig:
    method: str
    profile: Profile
    train: TrainConfig = field(default_factory=TrainConfig)
    method_options: dict[str, Any] = field(default_factory=dict)
    backend: Literal["netns", "docker"] = "netns"
    clusters: int = 2
    stages: int = 1
    # Docker backend only: "auto" (one GPU per rank when the nvidia runtime is present), "none", or ids "0,1".
    gpus: str = "auto"
    mode: Literal["train", "calibrate"] = "train"
    calibrate: bool = False
    # What adds the profile's delay, jitter and loss: netem where the kernel has it (auto), else the userspace delay
    # line (harness/net/delayline.py). The runner resolves auto and records the choice.
    link_emulator: Literal["auto", "netem", "userspace"] = "auto"
    # Faults to inject, as given: "KIND:STEP:ARG" (harness/run/faults.py).
    faults: tuple[str, ...] = ()
    # Write the run's scalars as TensorBoard event files in <run folder>/tensorboard while it trains
    # (harness/run/tensorboard.py).
    tensorboard: bool = False
    # Log the same scalars, the config and the summary to Weights & Biases while it trains (WANDB_PROJECT,
    # WANDB_MODE=offline: harness/run/weights_and_biases.py); the W&B files lie in <run folder>/wandb.
    wandb: bool = False
    # Save every rank's training state every this many steps (0: never), in <run folder>/checkpoints, so that
    # `harness run --resume` continues the run bit for bit (trainers/checkpoint.py); methods with communication
    # in flight save at the first step after that where none is.
    checkpoint_every: int = 0
    # How the run survives failures (harness/run/fault_tolerance.py): off, or torchft replicas that restart and heal.
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    # How long a rank waits in one collective before giving up (gloo/NCCL's timeout); the harness's watchdog fails
    # a run whose ranks log nothing for max(this, 10 x the slowest step so far). HARNESS_TIMEOUT_S sets the default.
    collective_timeout_s: float = field(default_factory=lambda: default_collective_timeout_s())
    # Short, unique and safe in interface names (15 characters at most): it prefixes every kernel object a run makes.
    run_key: str = field(default_factory=lambda: new_run_key())
    run_id: str = ""
    # Where a method not built in comes from (trainers/registry.py): /abs/file.py:Class, or an installed package's
    # module:Class; "" for a built-in. Filled in from the registry; a config read back registers its file again.
    method_source: str = ""

    def __post_init__(self) -> None:
        from trainers.registry import PluginError, is_file_spec, method_source, register_file

        try:
            if is_file_spec(self.method_source):
                register_file(self.method_source, expected_name=self.method)
        except PluginError as err:
            raise UserError(str(err)) from None
        self.method_source = self.method_source or method_source(self.method)
        if not self.run_id:
            stamp = time.strftime("%Y%m%dT%H%M%S")
            self.run_id = f"{stamp}-{self.method}-{self.profile.name}-{self.run_key}"

    @functools.cached_property
    def method_config(self) -> MethodConfig:
        """The method's typed, validated config, built once from (method, method_options); raises UserError."""
        return check_method_options(self.method, self.method_options)

    @property
    def resolved_options(self) -> dict[str, Any]:
        """Every field of method_config, defaults included, JSON-safe: what config.json and summary.json record as
        method_options (`method_options` here, and method_options_given there, are only the options given)."""
        from trainers.registry import recorded_options

        return recorded_options(self.method_config)

    def validate(self) -> None:
        """Everything the user chose, checked together before the host is touched; raises UserError."""
        Topology(self.clusters, self.stages)
        self.profile.check_sites(self.clusters)
        if self.link_emulator not in LINK_EMULATORS:
            raise UserError(f"--link-emulator must be one of {', '.join(LINK_EMULATORS)}, got {self.link_emulator!r}")
        check_faults(
            self.parsed_faults(),
            self.train.steps,
            self.clusters * self.stages,
            self.backend,
            self.profile.inter_cluster.rate_bps,
            link=self.profile.inter_cluster,
        )
        self._check_trace()
        self._check_scalar_writers()
        self._check_checkpoints()
        self._check_fault_tolerance()
        if (self.mode == "calibrate" or self.calibrate) and self.clusters < 2:
            raise UserError("calibration measures the link between clusters; use --clusters 2 or more")
        ranks_share_memory = capabilities(self.backend).ranks_share_host_cpus
        self._check_host_side(ranks_share_memory)
        try:
            self.train.validate()
            # Imported here: the model and method registries load torch, which commands that only read
            # profiles or results do not need.
            from trainers.models import parameter_shapes

            model_cfg = self.train.model_config()
            if self.train.seq_len > model_cfg.max_seq_len:
                raise ValueError(
                    f"--seq-len {self.train.seq_len} exceeds model {model_cfg.name!r}'s "
                    f"{model_cfg.max_seq_len}; use a shorter one"
                )
            self._check_token_count(self.train.seq_len or model_cfg.max_seq_len)
            shapes = parameter_shapes(model_cfg)
            self.method_config.check_shapes(shapes)
            if self.stages > 1:
                from trainers.pipeline import validate_pipeline

                microbatches = self.train.microbatches or self.stages
                validate_pipeline(model_cfg, self.stages, microbatches, self.train.batch_size)
        # The training side reports a bad setting as ValueError (or TypeError for a value of the wrong kind):
        # here, and only here, that becomes the user's error.
        except (ValueError, TypeError) as err:
            raise UserError(str(err)) from None
        # Ranks that share the host's cores share its memory too (netns); a container's GPU memory is not checked.
        if ranks_share_memory:
            self._check_memory(shapes, model_cfg)
        # Built here, where a setting the method refuses is named before the host is touched; kept for its readers.
        from trainers.registry import check_applicable

        try:
            check_applicable(self.method, self.method_config, self.method_options)
        except ValueError as err:
            raise UserError(str(err)) from None
        check_finite_options(self.method_options)
        check_shapeable(self.profile)
        if self.mode == "train":
            # Last, as it reads the corpus (~0.1 s for the default one): every cheaper mistake is named first.
            from trainers.data import check_data

            seq_len = self.train.seq_len or model_cfg.max_seq_len
            check = functools.partial(
                check_data,
                self.train.data,
                seq_len,
                self.clusters,
                data_shift=self.train.data_shift,
                tokenizer=self.train.tokenizer,
                text_field=self.train.data_field,
            )
            try:
                check() if self.train.tokenizer == BYTES else run_interruptibly(check)
            except ValueError as err:
                raise UserError(str(err)) from None

    def _check_token_count(self, seq_len: int) -> None:
        """Token counts are 64-bit integers (events, torch): a run past that is no run this harness can count."""
        tokens_per_step = self.clusters * self.train.batch_size * seq_len
        if self.train.steps * tokens_per_step >= 2**63:
            raise ValueError(
                f"--steps {self.train.steps:,} x {tokens_per_step:,} tokens a step is more tokens than a 64-bit count "
                "holds; use fewer --steps"
            )

    def _check_memory(self, shapes: list, model_cfg: Any) -> None:
        """The ranks' model state and one step's logits against what this host has (harness/run/memory.py)."""
        available = available_bytes()
        check_fits(shapes, self.clusters * self.stages, self.stages, available)
        seq_len = self.train.seq_len or model_cfg.max_seq_len
        check_batch_fits(self.train.batch_size, seq_len, model_cfg.vocab_size, self.clusters, available)

    def _check_checkpoints(self) -> None:
        """checkpoint_every: a number of steps, for a training run of a method that can be resumed."""
        every = self.checkpoint_every
        if not (isinstance(every, int) and not isinstance(every, bool) and every >= 0):
            raise UserError(f"checkpoint_every must be 0 (off) or a positive number of steps, got {every!r}")
        if not every:
            return
        if self.mode != "train":
            raise UserError("checkpoint_every applies to training runs; leave it out of calibration")
        if every >= self.train.steps:
            raise UserError(
                f"checkpoint_every={every} would save nothing in a run of {self.train.steps} steps (none is saved "
                f"after the last step); use fewer than {self.train.steps}"
            )
        from trainers.registry import method_class

        if not method_class(self.method).resumable:
            raise UserError(
                f"method {self.method} cannot be checkpointed (it does not declare its whole state: "
                "trainers/method.py, Method.resumable); leave out checkpoint_every"
            )
        try:
            refusal = self.method_config.checkpoint_refusal()
        except (ValueError, TypeError):
            return  # the method's own check names the bad setting, later in validate
        if refusal:
            raise UserError(f"checkpoint_every: {refusal}")

    def _check_scalar_writers(self) -> None:
        """--tensorboard and --wandb need their optional packages (harness/run/tensorboard.py and wandb)."""
        if self.tensorboard:
            from harness.run.tensorboard import check_available

            check_available()
        if self.wandb:
            from harness.run import weights_and_biases

            weights_and_biases.check_available()

    def _check_host_side(self, ranks_on_this_host: bool) -> None:
        """Before transformers is imported and the model built on the meta device (seconds): a decoder far too large
        for the host is refused from its config.json alone (harness/run/memory.py's parameters_at_least); ranks
        elsewhere (containers) cannot load a method from a file on this host."""
        if ranks_on_this_host:
            bound = parameters_at_least(self.train.model)
            if bound is not None:
                check_parameters_fit(bound, self.clusters * self.stages, self.stages, available_bytes(), at_least=True)
        elif is_file_spec(self.method_source):
            raise UserError(
                f"the {self.backend} backend's ranks do not see this host's files, so they cannot load the method "
                f"from {self.method_source.rpartition(':')[0]}; use --backend netns, or install it in the image as a "
                "package with a harness.methods entry point"
            )

    def _check_fault_tolerance(self) -> None:
        kills = [f.step for f in self.parsed_faults() if f.kind == "kill"]
        check_fault_tolerance(
            self.fault_tolerance,
            self.method,
            self.method_config.fault_tolerance_refusal() if self.fault_tolerance.enabled else None,
            self.clusters,
            self.stages,
            self.backend,
            {step: kills.count(step) for step in kills},
            self.checkpoint_every,
        )
        if (self.mode == "calibrate" or self.calibrate) and self.fault_tolerance.enabled:
            raise UserError(
                "calibration measures the link with a plain all-reduce, which fault tolerance does not run; calibrate "
                "without fault tolerance (the link is the same)"
            )

    def _check_trace(self) -> None:
        """A replayed trace (harness/net/trace.py) needs links that change under a live run, and sets the rate alone."""
        if self.profile.trace is None:
            return
        if not capabilities(self.backend).link_faults:
            raise UserError(
                f"profile {self.profile.name!r} replays a trace, which needs the netns backend (whose links can change "
                "under a live run); use --backend netns or a profile without a trace"
            )
        if replays_rate(self.profile.trace) and any(f.kind == "rate" for f in self.parsed_faults()):
            raise UserError(
                f"--fault rate and profile {self.profile.name!r}'s trace both set the link's rate; drop the fault or "
                "use a trace without a rate column"
            )

    def parsed_faults(self) -> tuple[Fault, ...]:
        return tuple(parse_fault(text) for text in self.faults)

    def warnings(self) -> list[str]:
        """Settings that run but measure little: call after validate(); each is one sentence naming the fix."""
        warnings = []
        if self.train.data_shift and self.train.data_shift >= self.train.steps:
            warnings.append(
                f"--data-shift {self.train.data_shift} is not below --steps {self.train.steps}: the data never "
                "shifts and each replica trains on one eighth of its shard; use a smaller --data-shift"
            )
        # One before training, one every eval_every steps, and one at the end when steps is not a multiple.
        evaluations = 1 + math.ceil(self.train.steps / self.train.eval_every)
        if evaluations < MIN_EVALUATIONS and self.train.steps >= MIN_CURVE_STEPS:
            every = max(1, self.train.steps // (MIN_EVALUATIONS - 1))
            warnings.append(
                f"--steps {self.train.steps} with --eval-every {self.train.eval_every} evaluates the held-out loss "
                f"only {evaluations} times: its curve and the time to reach a target loss are read at "
                f"{self.train.eval_every}-step resolution; use --eval-every {every} or less"
            )
        cfg = self.method_config
        if self.clusters == 1 and self.method != "local":
            given = ", ".join(f"{k}={v}" for k, v in self.method_options.items())
            warnings.append(
                f"with --clusters 1 there is one replica and no link between clusters: {self.method} never exchanges "
                f"anything{f' and its settings ({given}) change nothing' if given else ''}, so it measures what local "
                "would; use --clusters 2 or more"
            )
        syncs = cfg.max_syncs(self.train.steps) if self.clusters > 1 else None
        if syncs is not None and syncs < MIN_SYNCS:
            warnings.append(
                f"{self.method} synchronizes at most {syncs} time(s) in {self.train.steps} steps (local_steps="
                f"{cfg.local_steps}): its throughput says little about communication; use more --steps or a "
                "smaller --set local_steps"
            )
        ranks, cores = self.clusters * self.stages, os.cpu_count() or 1
        if capabilities(self.backend).ranks_share_host_cpus and ranks > cores:
            warnings.append(
                f"{ranks} ranks share {cores} CPU cores (each computes at ~{cores / ranks:.0%} of a core): compute, "
                "not the link, may set the pace, so compare methods at the same cluster count or use fewer --clusters"
            )
        warnings += self._unused_settings()
        for text, fault in zip(self.faults, self.parsed_faults(), strict=True):
            # A collective that waits through the whole outage gives up before the link is back.
            if fault.kind == "link-down" and fault.seconds >= self.collective_timeout_s:
                warnings.append(
                    f"--fault {text} keeps the link down for {fault.seconds:g} s, not less than the collective timeout "
                    f"({self.collective_timeout_s:g} s, HARNESS_TIMEOUT_S): the ranks will give up during the outage "
                    "and the run fail; use a shorter outage or a longer HARNESS_TIMEOUT_S"
                )
        return warnings

    def _unused_settings(self) -> list[str]:
        """Settings given (other than their defaults) that this run has no use for: said, not silently dropped."""
        from trainers.documents import holds_records

        unused = []
        if self.gpus != RunConfig.gpus and self.backend != "docker":
            unused.append(
                f"--gpus {self.gpus} applies to the docker backend; the {self.backend} backend's ranks use this "
                "host's devices as they find them (HARNESS_DEVICE=cpu keeps them on the CPU); leave it out"
            )
        defaults = TrainConfig()
        if self.stages == 1 and (self.train.pipeline_schedule != defaults.pipeline_schedule or self.train.microbatches):
            unused.append(
                "--pipeline-schedule and --microbatches apply to pipeline stages, and this run has one stage; use "
                "--stages 2 or more, or leave them out"
            )
        if self.train.data_field != defaults.data_field and not (
            self.train.data and holds_records(Path(self.train.data))
        ):
            unused.append(
                f"--data-field {self.train.data_field} names the text field of JSONL, parquet or saved-dataset "
                "--data, and this run reads plain text; leave it out"
            )
        if self.link_emulator == "netem" and not self.profile.needs_netem:
            unused.append(
                f"--link-emulator netem: profile {self.profile.name!r} asks for no delay, jitter or loss, so no link "
                "emulator runs; leave it out"
            )
        return unused

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["profile"] = self.profile.to_dict()
        data["method_options"], data["method_options_given"] = self.resolved_options, data["method_options"]
        return data

    def save(self, path: Path) -> None:
        """config.json: the config, and the hashes of the files outside the repository it reads (inputs.py)."""
        inputs = input_record(self.train, self.method_source)
        path.write_text(json.dumps({**self.to_dict(), "inputs": inputs}, indent=2))

    @classmethod
    def build(
        cls,
        method: str,
        profile: str | Profile,
        *,
        clusters: int = 2,
        stages: int = 1,
        backend: Literal["netns", "docker"] = "netns",
        gpus: str = "auto",
        mode: Literal["train", "calibrate"] = "train",
        calibrate: bool = False,
        link_emulator: Literal["auto", "netem", "userspace"] = "auto",
        faults: tuple[str, ...] = (),
        tensorboard: bool = False,
        wandb: bool = False,
        checkpoint_every: int = 0,
        collective_timeout_s: float | None = None,
        fault_tolerance: str = "none",
        min_replicas: int | None = None,
        restart_delay_s: float | None = None,
        replica_timeout_s: float | None = None,
        mtbf_s: float | str | None = None,
        failure_seed: int | None = None,
        **settings: Any,
    ) -> RunConfig:
        """A run from flat settings, as the CLI and sweeps have them.

        Keys that name a TrainConfig field set it; `lr` sets the inner learning rate; every other key is an option
        of the method (checked against the method's config when the run is validated). None means "default".
        """
        settings = {k: v for k, v in settings.items() if v is not None}
        train_keys = {f.name for f in dataclasses.fields(TrainConfig)} - {"optim"}
        train_settings = {k: settings.pop(k) for k in list(settings) if k in train_keys}
        optim = OptimConfig(lr=settings.pop("lr")) if "lr" in settings else OptimConfig()
        train = absolute_paths(TrainConfig(**train_settings, optim=optim))
        if "throughput_warmup_steps" not in train_settings and train.throughput_warmup_steps >= train.steps:
            train = dataclasses.replace(train, throughput_warmup_steps=train.steps // 10)
        return cls(
            method=resolve_method(method),
            profile=profile if isinstance(profile, Profile) else load_profile(profile),
            train=train,
            method_options=settings,
            backend=backend,
            gpus=gpus,
            clusters=clusters,
            stages=stages,
            mode=mode,
            calibrate=calibrate,
            link_emulator=link_emulator,
            faults=tuple(faults),
            tensorboard=tensorboard,
            wandb=wandb,
            checkpoint_every=checkpoint_every,
            fault_tolerance=FaultTolerance(
                fault_tolerance,
                **{
                    k: v
                    for k, v in (
                        ("min_replicas", min_replicas),
                        ("restart_delay_s", restart_delay_s),
                        ("replica_timeout_s", replica_timeout_s),
                        # "none", as --set reads it: no random failures.
                        ("mtbf_s", None if mtbf_s == "none" else mtbf_s),
                        ("failure_seed", failure_seed),
                    )
                    if v is not None
                },
            ),
            **({} if collective_timeout_s is None else {"collective_timeout_s": collective_timeout_s}),
        )

    @classmethod
    def load(cls, path: Path) -> RunConfig:
        data = json.loads(path.read_text())
        profile = Profile.from_dict(data.pop("profile"))
        train = data.pop("train")
        optim = train.pop("optim")
        optim["betas"] = tuple(optim["betas"])
        data["faults"] = tuple(data.get("faults", ()))
        data["fault_tolerance"] = FaultTolerance(**data.get("fault_tolerance", {}))
        data.pop("inputs", None)
        # What the user gave is the config's input; a config.json older than method_options_given holds only that.
        data["method_options"] = data.pop("method_options_given", data.get("method_options", {}))
        return cls(profile=profile, train=TrainConfig(optim=OptimConfig(**optim), **train), **data)
