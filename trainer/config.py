"""Typed configuration: the structured schemas of every config group and the validation of a run.

Hydra composes conf/ + overrides onto these dataclasses (registered in the ConfigStore as
`<option>_schema`), which rejects unknown keys and wrong types. `validate` then checks what a type
cannot express (batch arithmetic, the parallel shortcuts against the chosen strategy, model shape
against sequence length...). Every failure is a `ConfigError`: one line naming the key and what is
allowed, printed by the CLI without a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from hydra.utils import get_class
from omegaconf import DictConfig, MISSING, OmegaConf

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
MODES = ("train", "plan")
RECIPES_DIR = CONF_DIR.parent / "recipes"
PLAN_FORMATS = ("table", "json")
ACCELERATORS = ("auto", "cpu", "cuda")


class ConfigError(ValueError):
    """An invalid configuration, reported as `key: what is wrong and what is allowed`."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)


@dataclass
class TrainerConfig:
    """Options of the training loop (`trainer.*`)."""

    # Stop after this many optimizer steps (None: only max_tokens decides).
    max_steps: Optional[int] = 200
    # Stop once this many tokens were consumed (None: only max_steps decides); the earlier limit wins.
    max_tokens: Optional[int] = None
    # Seed of weights, data order and dropout: the same seed and config give the same run.
    seed: int = 1337
    # Processes per node (one per GPU, or CPU workers with gloo).
    devices: int = 1
    # Number of nodes; world size = devices * num_nodes.
    num_nodes: int = 1
    # Sequences per forward pass on one rank.
    micro_batch_size: int = 8
    # Sequences per optimizer step over all data-parallel ranks
    # (= micro_batch_size x accumulation steps x data-parallel size).
    global_batch_size: int = 16
    # Tokens per sequence.
    seq_len: int = 256
    # Validate every N optimizer steps (0: only at the end).
    val_every: int = 100
    # Global batches of validation data at each evaluation (the same sequences for every strategy).
    val_batches: int = 4
    # Write metrics every N optimizer steps.
    log_every: int = 10
    # Clip the global gradient norm to this value (0 disables clipping; the norm is logged anyway).
    grad_clip: float = 1.0
    # torch.compile each transformer block.
    compile: bool = False
    # auto (CUDA if present, else CPU), cpu or cuda.
    accelerator: str = "auto"
    # Intra-op threads per process (None: PyTorch's default, cores / local processes when launched).
    num_threads: Optional[int] = None
    # Peak FLOP/s of one device for MFU (None: from the GPU model, or a measured matmul peak on CPU).
    peak_flops: Optional[float] = None
    # Multi-node runs started by `python -m trainer` on each node (not torchrun/srun): host:port of the
    # rendezvous (node 0's address) and an id shared by the nodes of one job.
    rdzv_endpoint: Optional[str] = None
    rdzv_id: str = "trainer"
    # Restart all workers this many times when one fails (0: the job ends with the failing rank's error).
    max_restarts: int = 0


@dataclass
class CSVLoggerConfig:
    """`metrics.csv` in the run directory (always written, whatever else is configured)."""

    _target_: str = "trainer.plugins.loggers.csv_logger"
    _partial_: bool = True
    # Rows are buffered and written every N logged steps (and at the end).
    flush_logs_every_n_steps: int = 10


@dataclass
class WandbLoggerConfig:
    """Weights & Biases; offline (files under the run directory) unless an API key is configured."""

    _target_: str = "trainer.plugins.loggers.wandb_logger"
    _partial_: bool = True
    project: str = "trainer"
    # Runs of one sweep share a group (the sweep directory name by default).
    group: Optional[str] = None
    # Run name (default: the run directory name).
    name: Optional[str] = None
    entity: Optional[str] = None
    # None: online only when WANDB_API_KEY or a netrc login exists; true/false forces it.
    offline: Optional[bool] = None
    tags: list[str] = field(default_factory=list)


@dataclass
class TensorBoardLoggerConfig:
    """TensorBoard event files under `<run_dir>/tensorboard`."""

    _target_: str = "trainer.plugins.loggers.tensorboard_logger"
    _partial_: bool = True
    subdir: str = "tensorboard"


@dataclass
class ProgressBarConfig:
    """Rank-0 progress: a live bar on a terminal, one line per logged step otherwise."""

    _target_: str = "trainer.plugins.callbacks.ProgressBar"


@dataclass
class SweepConfig:
    """Options of the jobs of a multirun sweep (`sweep.*`; they apply to single runs too)."""

    # Before starting any worker, ask the planner whether the job fits in memory; a job that does not
    # is not run and is recorded as `skipped_unfit` in its status.json (see trainer/sweep.py).
    skip_unfit: bool = False
    # The fit check: a function config -> plan with a boolean `.fits` (the project's planner by default).
    planner: str = "trainer.planner.plan"


@dataclass
class PlanConfig:
    """Options of `mode=plan` (`plan.*`): memory, communication, time and fit of the composed config on the
    `hardware` group's machine, without running it (trainer/planner, docs/ARCHITECTURE.md)."""

    # table (a human report) or json (the report, then one JSON object as the last line of output).
    format: str = "table"
    # Also build the real model on the meta device under a fake process group and count the analysed
    # rank's parameter, gradient and optimizer bytes exactly (shown beside the analytic figures).
    exact: bool = True
    # Global rank to analyse (null: the rank with the highest device-memory estimate).
    rank: Optional[int] = None
    # Enumerate dp, tp, pp, ZeRO stage / FSDP mode, checkpointing policy, schedule and micro-batch for the
    # world size and hardware, keep what fits, rank by estimated throughput (always done when the
    # configuration does not fit).
    search: bool = False
    # Suggestions printed by the search.
    top: int = 5
    # Fraction of usable device (and host) memory kept free for allocator fragmentation and what the
    # estimate leaves out.
    headroom: float = 0.1
    # Fraction of the peak FLOP/s the model's matmuls reach (step time, tokens/s, MFU estimates).
    matmul_efficiency: float = 0.6
    # Write a memory-breakdown bar chart (PNG) to this path (null: no chart).
    chart: Optional[str] = None


@dataclass
class Config:
    """The whole run. Group nodes are typed by their own `<option>_schema`."""

    model: Any = MISSING
    data: Any = MISSING
    strategy: Any = MISSING
    precision: Any = MISSING
    activation_checkpointing: Any = MISSING
    optimizer: Any = MISSING
    lr_schedule: Any = MISSING
    # Named loggers (csv is always added); e.g. `logger=[csv,wandb]`.
    logger: dict[str, Any] = field(default_factory=dict)
    # Named callbacks; add your own with `+callbacks.NAME._target_=pkg.Class`.
    callbacks: dict[str, Any] = field(default_factory=dict)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    # The machine `mode=plan` plans for (conf/hardware/*.yaml); a run ignores it.
    hardware: Any = MISSING
    # What to do: `train`, or `plan` (print the memory/time/fit report, exit 3 when it does not fit).
    mode: str = "train"
    # Parallel sizes (shortcuts): data parallel (`auto`: the world size / (tp x pp)), tensor parallel,
    # pipeline parallel.
    dp: Any = "auto"
    tp: int = 1
    pp: int = 1
    # Context parallelism (sequence split across ranks for attention): not built; must stay 1.
    cp: int = 1
    # Where the run starts: auto (the latest complete checkpoint in the run's checkpoint directory, a
    # fresh start if there is none), none, or the path of a checkpoint or of a directory of checkpoints.
    resume: str = "auto"
    # Start a new run (step 0, fresh optimizer) from these weights: a checkpoint or a Hugging Face Llama
    # directory (config.json + *.safetensors); null: initialize from the seed.
    init_from: Optional[str] = None


def register_configs() -> None:
    """Put every schema in Hydra's ConfigStore (idempotent)."""
    from trainer.plugins.activation_checkpointing import ACTIVATION_CHECKPOINTING_SCHEMAS
    from trainer.plugins.lr_schedules import (
        ConstantScheduleConfig,
        CosineScheduleConfig,
        InverseSqrtScheduleConfig,
        LinearScheduleConfig,
        WSDScheduleConfig,
    )
    from trainer.plugins.precision import PRECISION_SCHEMAS
    from trainer.plugins.strategies import STRATEGY_SCHEMAS
    from trainer.data import StdlibDataConfig, TokenFileDataConfig
    from trainer.models import GPTConfig, LlamaConfig
    from trainer.optim import AdamWConfig, SGDConfig

    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    from trainer.planner.hardware import HardwareConfig

    cs.store(group="hardware", name="hardware_schema", node=HardwareConfig)
    _register_recipes(cs)
    schemas: dict[str, dict[str, Any]] = {
        "model": {"llama": LlamaConfig, "gpt": GPTConfig},
        "data": {"stdlib": StdlibDataConfig, "token_file": TokenFileDataConfig},
        "strategy": STRATEGY_SCHEMAS,
        "precision": PRECISION_SCHEMAS,
        "activation_checkpointing": ACTIVATION_CHECKPOINTING_SCHEMAS,
        "optimizer": {"adamw": AdamWConfig, "sgd": SGDConfig},
        "lr_schedule": {
            "constant": ConstantScheduleConfig,
            "cosine": CosineScheduleConfig,
            "linear": LinearScheduleConfig,
            "wsd": WSDScheduleConfig,
            "inverse_sqrt": InverseSqrtScheduleConfig,
        },
    }
    for group, options in schemas.items():
        for name, node in options.items():
            cs.store(group=group, name=f"{name}_schema", node=node)
    # Logger and callback options are stored under their own key inside the group's node.
    for name, node in {"csv": CSVLoggerConfig, "wandb": WandbLoggerConfig, "tensorboard": TensorBoardLoggerConfig}.items():
        cs.store(group="logger", name=f"{name}_schema", node=node, package=f"logger.{name}")
    cs.store(group="callbacks", name="progress_bar_schema", node=ProgressBarConfig, package="callbacks.progress_bar")
    from trainer.plugins.callbacks.monitors import MemoryMonitorConfig, ThroughputMonitorConfig

    cs.store(group="callbacks", name="throughput_schema", node=ThroughputMonitorConfig, package="callbacks.throughput")
    cs.store(group="callbacks", name="memory_schema", node=MemoryMonitorConfig, package="callbacks.memory")
    from trainer.plugins.callbacks.stabilizer import LossSpikeStabilizerConfig

    cs.store(group="callbacks", name="stabilizer_schema", node=LossSpikeStabilizerConfig, package="callbacks.stabilizer")
    from trainer.plugins.callbacks.checkpoint import CheckpointManagerConfig

    cs.store(group="callbacks", name="checkpoint_schema", node=CheckpointManagerConfig, package="callbacks.checkpoint")


_STORED_RECIPES: dict[Path, float] = {}


def _register_recipes(cs: ConfigStore) -> None:
    """recipes/*.yaml as the `recipe` group (`recipe=NAME`): `# @package _global_` files of overrides,
    stored under their own group name because the directory name is fixed by the project layout. A file
    is read again only when it changed (compose calls this every time)."""
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        mtime = path.stat().st_mtime
        if _STORED_RECIPES.get(path) != mtime:
            cs.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")
            _STORED_RECIPES[path] = mtime


# ---- derived quantities ------------------------------------------------------------------------------
def tokens_per_step(cfg: DictConfig) -> int:
    return int(cfg.trainer.global_batch_size) * int(cfg.trainer.seq_len)


def total_steps(cfg: DictConfig) -> int:
    """Optimizer steps of the run: the earlier of max_steps and max_tokens."""
    limits = []
    if cfg.trainer.max_steps is not None:
        limits.append(int(cfg.trainer.max_steps))
    if cfg.trainer.max_tokens is not None:
        limits.append(math.ceil(int(cfg.trainer.max_tokens) / tokens_per_step(cfg)))
    return min(limits)


def strategy_class(cfg: DictConfig) -> type:
    return get_class(cfg.strategy._target_)


def world_size(cfg: DictConfig) -> int:
    return int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)


def data_parallel_size(cfg: DictConfig) -> int:
    """Ranks that read distinct data: the world divided by the model-parallel sizes."""
    if not strategy_class(cfg).uses_dp:
        return 1
    if cfg.dp == "auto":
        return max(1, world_size(cfg) // (int(cfg.tp) * int(cfg.pp)))
    return int(cfg.dp)


def gradient_accumulation_steps(cfg: DictConfig) -> int:
    per_step = int(cfg.trainer.micro_batch_size) * data_parallel_size(cfg)
    return int(cfg.trainer.global_batch_size) // per_step


# ---- validation --------------------------------------------------------------------------------------
def _require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(key, message)


def _validate_trainer(t: DictConfig) -> None:
    _require(t.max_steps is not None or t.max_tokens is not None, "trainer.max_steps",
             "set trainer.max_steps or trainer.max_tokens (both are null)")
    for key in ("max_steps", "max_tokens"):
        value = t[key]
        _require(value is None or value > 0, f"trainer.{key}", f"must be a positive integer or null, got {value}")
    for key in ("devices", "num_nodes", "micro_batch_size", "global_batch_size", "seq_len", "log_every",
                "val_batches"):
        _require(t[key] >= 1, f"trainer.{key}", f"must be >= 1, got {t[key]}")
    _require(t.val_every >= 0, "trainer.val_every", f"must be >= 0 (0: validate only at the end), got {t.val_every}")
    _require(t.grad_clip >= 0, "trainer.grad_clip", f"must be >= 0 (0 disables clipping), got {t.grad_clip}")
    _require(t.accelerator in ACCELERATORS, "trainer.accelerator",
             f"'{t.accelerator}' is not one of {', '.join(ACCELERATORS)}")
    _require(t.num_threads is None or t.num_threads >= 1, "trainer.num_threads",
             f"must be >= 1 or null, got {t.num_threads}")
    _require(t.peak_flops is None or t.peak_flops > 0, "trainer.peak_flops", "must be positive or null")
    _require(t.max_restarts >= 0, "trainer.max_restarts", f"must be >= 0, got {t.max_restarts}")


def _validate_parallel_shortcuts(cfg: DictConfig) -> None:
    """dp/tp/pp above 1 need a strategy that uses them, and the sizes must multiply to the world."""
    strategy = strategy_class(cfg)
    name = cfg.strategy.get("name", None) or getattr(strategy, "name", "?")
    hints = {
        "dp": ("uses_dp", "data parallelism: pick strategy=ddp, zero1, zero2, zero3, fsdp or 3d"),
        "tp": ("uses_tp", "tensor parallelism: pick strategy=tp or strategy=3d"),
        "pp": ("uses_pp", "pipeline parallelism: pick strategy=pp or strategy=3d"),
    }
    for key, (flag, hint) in hints.items():
        value = cfg[key]
        if key == "dp" and value == "auto":
            continue
        _require(isinstance(value, int) and value >= 1, key, f"must be a positive integer, got {value!r}")
        _require(value == 1 or getattr(strategy, flag), key,
                 f"{key}={value} needs {hint} (strategy={name} does not use it)")
    world = world_size(cfg)
    if not (strategy.uses_dp or strategy.uses_tp or strategy.uses_pp):
        _require(world == 1, "trainer.devices",
                 f"trainer.devices x trainer.num_nodes = {world} processes, but strategy={name} runs one "
                 "process: pick a multi-process strategy (ddp, zero1, zero2, zero3, fsdp, tp, pp, 3d)")
        return
    model_parallel = int(cfg.tp) * int(cfg.pp)
    if not strategy.uses_dp:
        _require(model_parallel == world, "trainer.devices",
                 f"strategy={name} has no data parallelism, so tp x pp = {cfg.tp} x {cfg.pp} = {model_parallel} "
                 f"must equal trainer.devices x trainer.num_nodes = {world}; for dp x tp x pp pick strategy=3d")
    elif cfg.dp == "auto":
        _require(world % model_parallel == 0, "trainer.devices",
                 f"trainer.devices x trainer.num_nodes = {world} is not divisible by tp x pp = "
                 f"{cfg.tp} x {cfg.pp} = {model_parallel}")
    else:
        product = int(cfg.dp) * model_parallel
        _require(product == world, "dp",
                 f"dp x tp x pp = {cfg.dp} x {cfg.tp} x {cfg.pp} = {product} does not match trainer.devices x "
                 f"trainer.num_nodes = {cfg.trainer.devices} x {cfg.trainer.num_nodes} = {world}")
    # a plan launches nothing: the rendezvous address only matters to a run
    _require(cfg.mode == "plan" or cfg.trainer.num_nodes == 1 or cfg.trainer.rdzv_endpoint is not None
             or _inside_launcher(),
             "trainer.rdzv_endpoint",
             "a multi-node run started with `python -m trainer` needs trainer.rdzv_endpoint=HOST:PORT "
             "(node 0's address); under torchrun or srun it is not needed")


def _inside_launcher() -> bool:
    from trainer.launch import distributed_environment

    return distributed_environment() is not None


def _device_type(accelerator: str) -> str:
    import torch

    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return accelerator


def _validate_strategy(cfg: DictConfig) -> None:
    """The strategy's own checks (options, how the data-parallel size factors), before any worker."""
    from hydra.utils import instantiate

    from hydra.errors import InstantiationException

    try:
        strategy = instantiate(cfg.strategy)
        # a plan checks the options against the planned machine, a run against this one
        device_type = cfg.hardware.device_type if cfg.mode == "plan" else _device_type(cfg.trainer.accelerator)
        strategy.check_device(device_type)
        if strategy.uses_dp:
            strategy.data_parallel_split(data_parallel_size(cfg))
        # -- pipeline parallelism (plugins/strategies/pipeline.py): stages vs layers and micro-batches --
        if getattr(strategy, "uses_pp", False) and hasattr(strategy, "validate_pipeline"):
            strategy.validate_pipeline(num_layers=int(cfg.model.n_layers), pp=int(cfg.pp),
                                       num_microbatches=gradient_accumulation_steps(cfg),
                                       compile=bool(cfg.trainer.compile))
    except (ValueError, InstantiationException) as error:
        cause = error.__cause__ if isinstance(error, InstantiationException) and error.__cause__ else error
        raise ConfigError("strategy", str(cause).splitlines()[0]) from None


def _validate_precision(cfg: DictConfig) -> None:
    """The precision's options, and whether the strategy can honour it (plugins/precision/compat.py)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        precision = instantiate(cfg.precision)
        check = getattr(precision, "check_strategy", None)  # a plugin without the base class has no rules
        if check is not None:
            # a plan checks against the planned machine (trainer/planner), a run against this one
            device_type = cfg.hardware.device_type if cfg.mode == "plan" else _device_type(cfg.trainer.accelerator)
            check(instantiate(cfg.strategy), device_type)
    except (ValueError, InstantiationException) as error:
        cause = error.__cause__ if isinstance(error, InstantiationException) and error.__cause__ else error
        raise ConfigError("precision", str(cause).splitlines()[0]) from None


def _validate_plan(cfg: DictConfig) -> None:
    p, hw = cfg.plan, cfg.hardware
    _require(p.format in PLAN_FORMATS, "plan.format", f"'{p.format}' is not one of {', '.join(PLAN_FORMATS)}")
    _require(p.top >= 1, "plan.top", f"must be >= 1, got {p.top}")
    _require(p.rank is None or 0 <= p.rank < world_size(cfg), "plan.rank",
             f"must be a rank of the world of {world_size(cfg)} (0 to {world_size(cfg) - 1}) or null, got {p.rank}")
    _require(0 <= p.headroom < 1, "plan.headroom", f"must be in [0, 1), got {p.headroom}")
    _require(0 < p.matmul_efficiency <= 1, "plan.matmul_efficiency", f"must be in (0, 1], got {p.matmul_efficiency}")
    _require(hw.device_type in ("cuda", "cpu"), "hardware.device_type", f"must be cuda or cpu, got {hw.device_type}")
    for key in ("memory_gb", "devices_per_node", "intra_node_bandwidth_gbps", "inter_node_bandwidth_gbps",
                "memory_bandwidth_gbps", "peak_flops_bf16", "peak_flops_fp16", "peak_flops_fp32"):
        _require(hw[key] > 0, f"hardware.{key}", f"must be positive, got {hw[key]}")


def _validate_batch(cfg: DictConfig) -> None:
    t = cfg.trainer
    dp = data_parallel_size(cfg)
    per_step = t.micro_batch_size * dp
    _require(t.global_batch_size % per_step == 0, "trainer.global_batch_size",
             f"{t.global_batch_size} is not a multiple of trainer.micro_batch_size x data-parallel size = "
             f"{t.micro_batch_size} x {dp} = {per_step}")


def _validate_model(cfg: DictConfig) -> None:
    try:
        model_cfg = OmegaConf.to_object(cfg.model)  # the model configs check their shapes on creation
    except ValueError as error:
        raise ConfigError("model", f"{error} (model={cfg.model.name})") from None
    # ---- tensor parallelism (plugins/strategies/tensor_parallel.py): can the model split over tp? ----
    check_tp = getattr(strategy_class(cfg), "check_tensor_parallel", None)
    if check_tp is not None and cfg.mode != "plan":  # a plan reports it as a warning (trainer/planner)
        try:
            check_tp(model_cfg, int(cfg.tp), int(cfg.trainer.seq_len),
                     bool(cfg.strategy.get("sequence_parallel", True)))
        except ValueError as error:
            raise ConfigError("tp", str(error)) from None
    # ---- end tensor parallelism ----
    max_seq_len = getattr(model_cfg, "max_seq_len", None)
    if max_seq_len is not None:
        _require(cfg.trainer.seq_len <= max_seq_len, "trainer.seq_len",
                 f"{cfg.trainer.seq_len} exceeds model.max_seq_len={max_seq_len} of model {cfg.model.name}")


def _validate_activation_checkpointing(cfg: DictConfig) -> None:
    """The policy's options and whether it can act on this model (e.g. every_n's n against n_layers)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        policy = instantiate(cfg.activation_checkpointing)
        policy.check_model(int(cfg.model.n_layers))
        policy.check_strategy(instantiate(cfg.strategy))
    except (ValueError, InstantiationException) as error:
        cause = error.__cause__ if isinstance(error, InstantiationException) and error.__cause__ else error
        raise ConfigError("activation_checkpointing", str(cause).splitlines()[0]) from None


def _validate_optimization(cfg: DictConfig) -> None:
    from hydra.utils import instantiate

    lr = cfg.optimizer.get("lr", None)
    _require(lr is None or lr > 0, "optimizer.lr", f"must be positive, got {lr}")
    wd = cfg.optimizer.get("weight_decay", 0.0)
    _require(wd >= 0, "optimizer.weight_decay", f"must be >= 0, got {wd}")
    try:
        instantiate(cfg.lr_schedule)(total_steps=total_steps(cfg))
    except ValueError as error:
        raise ConfigError("lr_schedule", str(error)) from None


def _validate_targets(cfg: DictConfig) -> None:
    """Every `_target_` must import, so a typo fails now rather than after the workers started."""
    from hydra.utils import get_object

    nodes = [(group, cfg[group]) for group in ("model", "data", "strategy", "precision",
                                               "activation_checkpointing", "optimizer", "lr_schedule")]
    nodes += [(f"logger.{k}", v) for k, v in cfg.logger.items()]
    nodes += [(f"callbacks.{k}", v) for k, v in cfg.callbacks.items()]
    for key, node in nodes:
        target = node.get("_target_", None) if isinstance(node, DictConfig) else None
        _require(target is not None, key, "has no _target_ (a plugin must name its class)")
        try:
            get_object(target)
        except Exception:  # noqa: BLE001 - any import failure means the same thing to the user
            raise ConfigError(f"{key}._target_", f"cannot import '{target}'") from None


def _validate_complete(cfg: DictConfig) -> None:
    missing = sorted(OmegaConf.missing_keys(cfg))
    _require(not missing, missing[0] if missing else "",
             f"required value is missing; set it on the command line ({missing[0] if missing else ''}=...)")


def _validate_known_keys(node: DictConfig, path: str = "") -> None:
    """`+key=value` bypasses the schema's struct check; refuse keys a typed node does not declare."""
    schema = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(schema):
        allowed = [f.name for f in dataclasses.fields(schema)]
        for key in node.keys():
            if key not in allowed:
                close = difflib.get_close_matches(str(key), allowed, n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                raise ConfigError(f"{path}{key}", f"unknown key; {hint}allowed: "
                                                  f"{', '.join(a for a in allowed if not a.startswith('_'))}")
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            _validate_known_keys(child, f"{path}{key}.")


def _validate_resume(cfg: DictConfig) -> None:
    """resume/init_from must name something loadable, checked before any worker starts."""
    from trainer.checkpoint.manifest import MANIFEST, complete_checkpoints

    resume = str(cfg.resume)
    if resume not in ("auto", "none"):
        path = Path(resume).expanduser()
        _require(path.exists(), "resume", f"{resume} does not exist (use auto, none or a checkpoint path)")
        _require((path / MANIFEST).is_file() or bool(complete_checkpoints(path)), "resume",
                 f"{resume} is neither a complete checkpoint ({MANIFEST}) nor a directory of checkpoints")
    if cfg.init_from is not None:
        path = Path(str(cfg.init_from)).expanduser()
        hf_model = (path / "config.json").is_file() and any(path.glob("*.safetensors"))
        _require((path / MANIFEST).is_file() or hf_model, "init_from",
                 f"{cfg.init_from} is neither a checkpoint ({MANIFEST}) nor a Hugging Face model directory "
                 "(config.json + *.safetensors)")


def _validate_callbacks(cfg: DictConfig) -> None:
    """A callback class may check its options before launch with a static `check_config(node)`."""
    from hydra.utils import get_object

    for name, node in cfg.callbacks.items():
        check = getattr(get_object(node._target_), "check_config", None)
        if check is not None:
            try:
                check(node)
            except (TypeError, ValueError) as error:
                raise ConfigError(f"callbacks.{name}", str(error).splitlines()[0]) from None


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError for the first inconsistency of a composed config."""
    _validate_known_keys(cfg)
    _validate_complete(cfg)
    _require(cfg.mode in MODES, "mode", f"'{cfg.mode}' is not one of {', '.join(MODES)}")
    _validate_plan(cfg)
    _require(cfg.cp == 1, "cp", f"cp={cfg.cp}: context parallelism is not available in this version (cp must be 1); "
                                "for long sequences use activation checkpointing or tensor parallelism with "
                                "sequence parallelism")
    _validate_trainer(cfg.trainer)
    _validate_targets(cfg)
    _validate_parallel_shortcuts(cfg)
    _validate_strategy(cfg)
    _validate_precision(cfg)
    _validate_batch(cfg)
    _validate_model(cfg)
    _validate_activation_checkpointing(cfg)
    _validate_optimization(cfg)
    _validate_callbacks(cfg)
    _validate_resume(cfg)


# ---- composition -------------------------------------------------------------------------------------
def compose(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """Compose conf/ with overrides outside of a Hydra app (tests, benchmarks, the CLI's preflight)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))


def group_options(group: str) -> list[str]:
    directory = RECIPES_DIR if group == "recipe" else CONF_DIR / group
    return sorted(p.stem for p in directory.glob("*.yaml"))


def _allowed_keys(full_key: str, overrides: list[str]) -> list[str]:
    """Keys that exist next to `full_key` in the config composed with the group choices only."""
    choices = [o for o in overrides if "=" in o and "." not in o.split("=", 1)[0].lstrip("+~")]
    try:
        node: Any = compose(choices)
    except Exception:  # noqa: BLE001 - fall back to the defaults
        node = compose([])
    parent = full_key.rsplit(".", 1)[0] if "." in full_key else ""
    for part in parent.split(".") if parent else []:
        node = node.get(part) if isinstance(node, DictConfig) else None
    if not isinstance(node, DictConfig):
        return []
    return [k for k in node.keys() if not str(k).startswith("_")]


def describe_compose_error(error: BaseException, overrides: list[str]) -> str:
    """One line out of Hydra's and OmegaConf's multi-line composition errors."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__

    for exc in chain:
        if isinstance(exc, MissingConfigException) and exc.missing_cfg_file:
            group = str(exc.missing_cfg_file).rsplit("/", 1)[0] if "/" in str(exc.missing_cfg_file) else ""
            choice = str(exc.missing_cfg_file).rsplit("/", 1)[-1]
            options = group_options(group) if group else []
            if group:
                return f"{group}={choice}: no such option; available: {', '.join(options)}"
            return f"no config named '{choice}'"
        if isinstance(exc, OverrideParseException):
            return f"cannot parse override: {exc.override!r} ({str(exc).splitlines()[0]})"
    for exc in chain:
        if isinstance(exc, (ConfigKeyError, ValidationError)) or isinstance(exc, OmegaConfBaseException):
            full_key = getattr(exc, "full_key", None) or ""
            message = str(getattr(exc, "msg", None) or exc).splitlines()[0]
            if isinstance(exc, ConfigKeyError) or "not in struct" in message or "not in '" in message:
                allowed = _allowed_keys(full_key, overrides)
                leaf = full_key.rsplit(".", 1)[-1]
                close = difflib.get_close_matches(leaf, allowed, n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                return f"{full_key}: unknown key; {hint}allowed: {', '.join(allowed)}"
            if isinstance(exc, ValidationError):
                return f"{full_key}: {message}"
            return f"{full_key}: {message}" if full_key else message
    return str(error).splitlines()[0]
