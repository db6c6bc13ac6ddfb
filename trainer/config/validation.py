"""Validation of a composed config: what a type cannot express, checked before anything starts.

The schemas (trainer/config/schema.py and each family's SCHEMAS) already reject unknown keys and wrong
types at composition. `validate` checks the rest: batch arithmetic, the parallel shortcuts against the
chosen strategy, model shape against sequence length, and each plugin's own rules. The strategy, the
precision and the activation-checkpointing policy are instantiated once here and asked through the hooks
their base classes declare (`Strategy.check_device`, `data_parallel_split`, `validate_pipeline`,
`check_tensor_parallel`; `Precision.check_strategy`; `ActivationCheckpointing.check_model`,
`check_strategy`; `Callback.check_config`, `Callback.requires`). Every failure is a `ConfigError` naming the
key. Classes named by `_target_` are resolved and compared with `issubclass`, never by their spelling.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from trainer.config.derived import (
    data_parallel_size,
    gradient_accumulation_steps,
    model_parallel_size,
    strategy_class,
    total_steps,
    world_size,
)
from trainer.config.errors import ConfigError
from trainer.config.schema import ACCELERATORS, MODES, PLAN_FORMATS
from trainer.environment import signal_numbers

if TYPE_CHECKING:
    from trainer.interfaces.activation_checkpointing import ActivationCheckpointing
    from trainer.interfaces.precision import Precision
    from trainer.interfaces.strategy import Strategy


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
    _require(t.throughput_warmup_steps >= 0, "trainer.throughput_warmup_steps",
             f"must be >= 0 (0: no warm-up left out), got {t.throughput_warmup_steps}")
    _require(t.val_every >= 0, "trainer.val_every", f"must be >= 0 (0: validate only at the end), got {t.val_every}")
    _require(t.grad_clip >= 0, "trainer.grad_clip", f"must be >= 0 (0 disables clipping), got {t.grad_clip}")
    try:
        signal_numbers(list(t.preemption_signals))
    except ValueError as error:
        raise ConfigError("trainer.preemption_signals", str(error)) from None
    _require(t.max_nonfinite_steps >= 0, "trainer.max_nonfinite_steps",
             f"must be >= 0 (0: skip non-finite steps without ever stopping), got {t.max_nonfinite_steps}")
    _require(t.accelerator in ACCELERATORS, "trainer.accelerator",
             f"'{t.accelerator}' is not one of {', '.join(ACCELERATORS)}")
    _require(t.num_threads is None or t.num_threads >= 1, "trainer.num_threads",
             f"must be >= 1 or null, got {t.num_threads}")
    _require(t.peak_flops is None or t.peak_flops > 0, "trainer.peak_flops", "must be positive or null")
    _require(t.max_restarts >= 0, "trainer.max_restarts", f"must be >= 0, got {t.max_restarts}")
    _require(t.hang_timeout_s >= 0, "trainer.hang_timeout_s", f"must be >= 0 (0: no watchdog), got {t.hang_timeout_s}")
    for key in ("hang_first_step_factor", "hang_save_factor"):
        _require(t[key] >= 1, f"trainer.{key}", f"must be >= 1, got {t[key]}")
    _require(t.straggler_margin >= 0, "trainer.straggler_margin", f"must be >= 0 (0: off), got {t.straggler_margin}")
    _require(t.straggler_steps >= 1, "trainer.straggler_steps", f"must be >= 1, got {t.straggler_steps}")
    _require(0 <= t.straggler_overhead < 1, "trainer.straggler_overhead",
             f"must be in [0, 1) (0: a report at every log step), got {t.straggler_overhead}")


def _validate_parallel_shortcuts(cfg: DictConfig) -> None:
    """dp/tp/pp/cp above 1 need a strategy that uses them, and the sizes must multiply to the world."""
    strategy = strategy_class(cfg)
    name = cfg.strategy.get("name", None) or strategy.name
    hints = {
        "dp": ("uses_dp", "data parallelism: pick strategy=ddp, zero1, zero2, zero3, fsdp or 3d"),
        "tp": ("uses_tp", "tensor parallelism: pick strategy=tp or strategy=3d"),
        "pp": ("uses_pp", "pipeline parallelism: pick strategy=pp or strategy=3d"),
        "cp": ("uses_cp", "context parallelism over several processes: pick strategy=ddp, zero1, zero2, zero3, "
                          "fsdp, tp, pp or 3d"),
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
    model_parallel = model_parallel_size(cfg)
    sizes = f"tp x pp x cp = {cfg.tp} x {cfg.pp} x {cfg.cp} = {model_parallel}"
    if not strategy.uses_dp:
        _require(model_parallel == world, "trainer.devices",
                 f"strategy={name} has no data parallelism, so {sizes} must equal trainer.devices x "
                 f"trainer.num_nodes = {world}; for dp x tp x pp pick strategy=3d")
    elif cfg.dp == "auto":
        _require(world % model_parallel == 0, "trainer.devices",
                 f"trainer.devices x trainer.num_nodes = {world} is not divisible by {sizes}")
    else:
        product = int(cfg.dp) * model_parallel
        _require(product == world, "dp",
                 f"dp x tp x pp x cp = {cfg.dp} x {cfg.tp} x {cfg.pp} x {cfg.cp} = {product} does not match "
                 f"trainer.devices x trainer.num_nodes = {cfg.trainer.devices} x {cfg.trainer.num_nodes} = {world}")
    # a plan launches nothing: the rendezvous address only matters to a run
    _require(cfg.mode == "plan" or cfg.trainer.num_nodes == 1 or cfg.trainer.rdzv_endpoint is not None
             or _inside_launcher(),
             "trainer.rdzv_endpoint",
             "a multi-node run started with `python -m trainer` needs trainer.rdzv_endpoint=HOST:PORT "
             "(node 0's address); under torchrun or srun it is not needed")


def _inside_launcher() -> bool:
    from trainer.environment import distributed_environment

    return distributed_environment() is not None


def _device_type(accelerator: str) -> str:
    import torch

    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return accelerator


def _checked_device_type(cfg: DictConfig) -> str:
    """The device the options are checked against: a plan's planned machine, a run's own machine."""
    return cfg.hardware.device_type if cfg.mode == "plan" else _device_type(cfg.trainer.accelerator)


def _plugin_error(key: str, error: Exception) -> ConfigError:
    """A plugin's own message (not Hydra's wrapper around it), first line only."""
    from hydra.errors import InstantiationException

    cause = error.__cause__ if isinstance(error, InstantiationException) and error.__cause__ else error
    return ConfigError(key, str(cause).splitlines()[0])


def _instantiate_plugin(cfg: DictConfig, group: str) -> Any:
    """Build the group's plugin once, for all the checks; options its constructor refuses are the group's
    error."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(cfg[group])
    except (ValueError, InstantiationException) as error:
        raise _plugin_error(group, error) from None


def _validate_strategy(cfg: DictConfig, strategy: "Strategy", device_type: str) -> None:
    """The strategy's own checks (options, how the data-parallel size factors), before any worker."""
    from hydra.errors import InstantiationException

    try:
        strategy.check_device(device_type)
        if strategy.uses_dp:
            strategy.data_parallel_split(data_parallel_size(cfg))
        # pipeline parallelism: stages vs layers and micro-batches (a no-op without pipeline stages)
        strategy.validate_pipeline(num_layers=int(cfg.model.n_layers), pp=int(cfg.pp),
                                   num_microbatches=gradient_accumulation_steps(cfg),
                                   compile=bool(cfg.trainer.compile),
                                   data_parallel=data_parallel_size(cfg) * int(cfg.cp))
    except (ValueError, InstantiationException) as error:
        raise _plugin_error("strategy", error) from None


def _validate_precision(precision: "Precision", strategy: "Strategy", device_type: str) -> None:
    """Whether the strategy can honour the precision on this device (the precision's own rules)."""
    from hydra.errors import InstantiationException

    try:
        precision.check_strategy(strategy, device_type)
    except (ValueError, InstantiationException) as error:
        raise _plugin_error("precision", error) from None


def _validate_plan(cfg: DictConfig) -> None:
    p, hw = cfg.plan, cfg.hardware
    _require(p.format in PLAN_FORMATS, "plan.format", f"'{p.format}' is not one of {', '.join(PLAN_FORMATS)}")
    _require(p.top >= 1, "plan.top", f"must be >= 1, got {p.top}")
    _require(p.rank is None or 0 <= p.rank < world_size(cfg), "plan.rank",
             f"must be a rank of the world of {world_size(cfg)} (0 to {world_size(cfg) - 1}) or null, got {p.rank}")
    _require(0 <= p.headroom < 1, "plan.headroom", f"must be in [0, 1), got {p.headroom}")
    _require(0 < p.matmul_efficiency <= 1, "plan.matmul_efficiency", f"must be in (0, 1], got {p.matmul_efficiency}")
    _require(p.attention_efficiency is None or 0 < p.attention_efficiency <= 1, "plan.attention_efficiency",
             f"must be in (0, 1] or null, got {p.attention_efficiency}")
    _require(p.calibrate_steps >= 1, "plan.calibrate_steps", f"must be >= 1, got {p.calibrate_steps}")
    _require(p.calibrate_warmup >= 2, "plan.calibrate_warmup",
             f"must be >= 2 (the second step reaches the peak memory), got {p.calibrate_warmup}")
    _require(p.calibrate_message_mb > 0, "plan.calibrate_message_mb", f"must be > 0, got {p.calibrate_message_mb}")
    _require(p.trials >= 0, "plan.trials", f"must be >= 0 (0: run the best predicted layout), got {p.trials}")
    _require(p.trial_steps >= 1, "plan.trial_steps", f"must be >= 1, got {p.trial_steps}")
    _require(p.trial_warmup >= 1, "plan.trial_warmup", f"must be >= 1 (the first step creates the optimizer "
                                                       f"states), got {p.trial_warmup}")
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


def _validate_model(cfg: DictConfig, strategy: "Strategy") -> None:
    try:
        model_cfg = OmegaConf.to_object(cfg.model)  # the model configs check their shapes on creation
    except ValueError as error:
        raise ConfigError("model", f"{error} (model={cfg.model.name})") from None
    _validate_model_family(cfg, model_cfg)
    # tensor parallelism: can the model split over tp? (a no-op for strategies without it)
    _validate_context_parallel(cfg, model_cfg)
    _validate_expert_parallel(cfg, model_cfg, strategy)
    if cfg.mode != "plan":  # a plan reports it as a warning (trainer/planner)
        try:  # each cp rank's tensor-parallel group splits that rank's part of the sequence
            strategy.check_tensor_parallel(model_cfg, int(cfg.tp), int(cfg.trainer.seq_len) // int(cfg.cp),
                                           bool(cfg.strategy.get("sequence_parallel", True)))
        except ValueError as error:
            raise ConfigError("tp", str(error)) from None
    max_seq_len = getattr(model_cfg, "max_seq_len", None)
    if max_seq_len is not None:
        _require(cfg.trainer.seq_len <= max_seq_len, "trainer.seq_len",
                 f"{cfg.trainer.seq_len} exceeds model.max_seq_len={max_seq_len} of model {cfg.model.name}")


def _validate_model_family(cfg: DictConfig, model_cfg: Any) -> None:
    """What the model's family says it cannot do: a parallel layout it has no plan for, a model the
    planner does not describe (only where the planner runs)."""
    from trainer.models import family_of

    family = family_of(model_cfg)
    problem = family.unsupported_parallelism(model_cfg, tp=int(cfg.tp), pp=int(cfg.pp), cp=int(cfg.cp))
    if problem is not None:
        raise ConfigError(*problem)
    if cfg.mode == "plan" or (cfg.mode == "train" and bool(cfg.trainer.preflight)):
        problem = family.unsupported_planning(model_cfg)
        if problem is not None:
            raise ConfigError(*problem)


def _validate_expert_parallel(cfg: DictConfig, model_cfg: Any, strategy: "Strategy") -> None:
    """ep borrows data-parallel ranks to split the experts: it needs an MoE model, a strategy that splits
    experts, and must divide both the experts and dp x cp."""
    ep = cfg.get("ep", 1)
    _require(isinstance(ep, int) and ep >= 1, "ep", f"must be a positive integer, got {ep!r}")
    if ep == 1:
        return
    n_experts = int(getattr(model_cfg, "n_experts", 0) or 0)
    _require(n_experts > 0, "ep", f"ep={ep} splits Mixture-of-Experts layers, but model {cfg.model.name} has none "
                                  "(set model.n_experts, e.g. model=tiny_moe)")
    name = cfg.strategy.get("name", None) or strategy.name
    _require(strategy.supports_ep, "ep", f"ep={ep} needs strategy=ddp, zero1, zero2, zero3, fsdp or 3d (strategy={name} "
                                         "has no data-parallel ranks to split experts over; with tp or pp use 3d)")
    _require(n_experts % ep == 0, "ep", f"ep={ep} does not divide model.n_experts={n_experts}")
    ranks = data_parallel_size(cfg) * int(cfg.cp)
    _require(ranks % ep == 0, "ep", f"ep={ep} does not divide the data-parallel x context-parallel size "
                                    f"{data_parallel_size(cfg)} x {cfg.cp} = {ranks} (experts borrow those ranks)")


def _validate_context_parallel(cfg: DictConfig, model_cfg: Any) -> None:
    """The method exists, the layout can cut the sequence, and all_to_all can split the heads."""
    from trainer.models.context_parallel import METHODS, load_balanced, sequence_divisor

    cp, method, seq_len = int(cfg.cp), str(cfg.cp_method), int(cfg.trainer.seq_len)
    _require(method in METHODS, "cp_method", f"'{method}' is not one of {', '.join(METHODS)}")
    if cp == 1:
        return
    divisor = sequence_divisor(cp, method)
    layout = (f"2 x cp = {divisor} chunks (ring attention's causal load balancing: rank r holds chunks r and "
              f"2cp-1-r)" if load_balanced(method) else f"cp = {divisor} contiguous shards")
    _require(seq_len % divisor == 0, "trainer.seq_len",
             f"{seq_len} cannot be cut into {layout}: pick a multiple of {divisor}")
    if method == "all_to_all":
        heads, tp = int(model_cfg.n_heads), int(cfg.tp)
        _require(heads % (tp * cp) == 0, "cp",
                 f"cp_method=all_to_all gives each cp rank n_heads / (tp x cp) query heads, but model.n_heads="
                 f"{heads} is not divisible by tp x cp = {tp} x {cp}: use cp_method=ring or another cp")


def _validate_activation_checkpointing(cfg: DictConfig, policy: "ActivationCheckpointing",
                                       strategy: "Strategy") -> None:
    """Whether the policy can act on this model (e.g. every_n's n against n_layers) and strategy."""
    from hydra.errors import InstantiationException

    try:
        policy.check_model(int(cfg.model.n_layers))
        policy.check_strategy(strategy, int(cfg.get("ep", 1)))
    except (ValueError, InstantiationException) as error:
        raise _plugin_error("activation_checkpointing", error) from None


def _validate_expert_overlap(cfg: DictConfig, policy: "ActivationCheckpointing", strategy: "Strategy") -> None:
    """A required overlap of the expert all-to-alls (DualPipeV's `strategy.expert_overlap=true`) can run."""
    try:
        strategy.check_expert_overlap(pp=int(cfg.pp), ep=int(cfg.get("ep", 1)), tp=int(cfg.tp), cp=int(cfg.cp),
                                      checkpointing=policy.name)
    except ValueError as error:
        raise ConfigError("strategy.expert_overlap", str(error)) from None


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _validate_optimizer_fields(node: DictConfig) -> None:
    """The fields every built-in optimizer shares, with messages that name the key (torch's own would be a
    traceback from inside the optimizer's constructor, after the workers started)."""
    lr = node.get("lr", None)
    _require(lr is None or (_finite_number(lr) and lr > 0), "optimizer.lr", f"must be positive, got {lr}")
    wd = node.get("weight_decay", 0.0)
    _require(_finite_number(wd) and wd >= 0, "optimizer.weight_decay", f"must be >= 0, got {wd}")
    if "betas" in node:
        betas = list(node.betas) if node.betas is not None else []
        _require(len(betas) == 2, "optimizer.betas", f"must be two numbers [beta1, beta2], got {betas}")
        for index, beta in enumerate(betas):
            _require(_finite_number(beta) and 0 <= beta < 1, "optimizer.betas",
                     f"each beta must be in [0, 1), got beta{index + 1}={beta} in {betas}")
    if "eps" in node:
        _require(_finite_number(node.eps) and node.eps > 0, "optimizer.eps", f"must be a positive number, got {node.eps}")
    if "momentum" in node:
        _require(_finite_number(node.momentum) and node.momentum >= 0, "optimizer.momentum",
                 f"must be >= 0 (0 disables momentum), got {node.momentum}")
        _require(not node.get("nesterov", False) or node.momentum > 0, "optimizer.nesterov",
                 f"nesterov needs optimizer.momentum > 0, got momentum={node.momentum}")
    if "dampening" in node:
        _require(_finite_number(node.dampening), "optimizer.dampening", f"must be a number, got {node.dampening}")
        _require(not node.get("nesterov", False) or node.dampening == 0, "optimizer.nesterov",
                 f"nesterov needs optimizer.dampening=0, got {node.dampening}")


def _validate_whole_matrix_optimizer(cfg: DictConfig, factory: Any) -> None:
    """An optimizer that orthogonalises whole matrices (Muon) finds them from each stepped tensor's layout;
    3d's zero1 flavour under tensor parallelism steps row views of tensor-parallel shards, a nesting of
    layouts it does not resolve."""
    from trainer.optim import wants_hidden_matrix_group

    if not wants_hidden_matrix_group(factory):
        return
    strategy = cfg.strategy
    if (str(strategy.get("_target_", "")).endswith(".ThreeD") and strategy.get("data_parallel") == "zero1"
            and int(cfg.tp) > 1):
        raise ConfigError("optimizer", f"{cfg.optimizer._target_} needs whole matrices, which strategy=3d "
                          "strategy.data_parallel=zero1 with tp > 1 does not let it gather (row views of tensor-"
                          "parallel shards); use strategy.data_parallel=zero3, fsdp or ddp, or tp=1")


def _validate_qk_clip(cfg: DictConfig, precision: "Precision", strategy: "Strategy") -> None:
    """QK-clip (`optimizer.qk_clip_tau`) scales the query/key projection rows of the parameters after each
    step: the model's family must say which rows make its logits, and no copy the optimizer steps in the
    parameters' place (fp32 masters, an offloaded optimizer's host copies) may overwrite the scaled rows."""
    import torch

    from trainer.models import family_of

    tau = cfg.optimizer.get("qk_clip_tau", None)
    if tau is None:
        return
    key = "optimizer.qk_clip_tau"
    _require(_finite_number(tau) and tau > 0, key, f"must be a positive number (or null: off), got {tau}")
    problem = family_of(OmegaConf.to_object(cfg.model)).unsupported_qk_clip(OmegaConf.to_object(cfg.model))
    _require(problem is None, key, f"{problem} (model={cfg.model.name})")
    _require(not (precision.master_weights and precision.param_dtype != torch.float32), key,
             "QK-clip scales the parameters, not the fp32 master copies this precision steps; use "
             "precision.master_weights=false or an fp32-parameter precision")
    _require(strategy.optimizer_host is None, key,
             "QK-clip scales the parameters, not the host copies an offloaded optimizer steps; set "
             "strategy.offload_optimizer=false")


def _validate_optimization(cfg: DictConfig) -> None:
    from hydra.utils import instantiate

    _validate_optimizer_fields(cfg.optimizer)
    # Whatever else the optimizer class checks (a custom `_target_`'s own options too): build it once on a
    # stand-in parameter, so its complaint is a one-line config error now.
    try:
        import torch

        from trainer.optim import optimizer_factory_from_config

        factory, weight_decay = optimizer_factory_from_config(cfg.optimizer)
        factory([{"params": [torch.nn.Parameter(torch.zeros(1))], "weight_decay": weight_decay}])
    except Exception as error:  # noqa: BLE001 - whatever the class refuses (Hydra wraps it) is a config error
        raise _plugin_error("optimizer", error) from None
    _validate_whole_matrix_optimizer(cfg, factory)
    try:
        instantiate(cfg.lr_schedule)(total_steps=total_steps(cfg))
    except (ValueError, TypeError) as error:
        raise ConfigError("lr_schedule", str(error).splitlines()[0]) from None
    except Exception as error:  # noqa: BLE001 - Hydra's InstantiationException around the schedule's own
        raise _plugin_error("lr_schedule", error) from None


def _is_source(node: DictConfig, source_class: type) -> bool:
    """Whether `data._target_` names `source_class` or a subclass (`_validate_targets` made sure it
    imports; a factory function is no class of ours)."""
    from hydra.utils import get_object

    target = get_object(str(node._target_))
    return isinstance(target, type) and issubclass(target, source_class)


def _validate_data_paths(cfg: DictConfig) -> None:
    """The data source's paths must be readable now, not when a worker first reads them. A source whose
    constructor only checks its files (the token-file dataset reads meta.json and file sizes; the arrays
    are memory-mapped lazily) is built once here, so a malformed dataset is one line too."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    from trainer.data.formats import MegatronIndexedDataset
    from trainer.data.token_file import TokenFileDataset

    node = cfg.data
    # a Megatron `path` is the prefix of PREFIX.bin / PREFIX.idx, checked with its index by `_validate_data`
    keys = ("root",) if _is_source(node, MegatronIndexedDataset) else ("path", "root")
    for key in keys:
        value = node.get(key, None)
        if value is None:
            continue
        path = Path(str(value)).expanduser()
        _require(path.exists(), f"data.{key}", f"{value} does not exist")
        _require(os.access(path, os.R_OK), f"data.{key}", f"{value} is not readable")
    if _is_source(node, TokenFileDataset):
        from trainer.data.config import source_config

        try:
            instantiate(source_config(node))
        except (OSError, ValueError, InstantiationException) as error:
            raise _plugin_error("data.path", error) from None


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
        _require(os.access(path, os.R_OK), "resume", f"{resume} is not readable")
        _require((path / MANIFEST).is_file() or bool(complete_checkpoints(path)), "resume",
                 f"{resume} is neither a complete checkpoint ({MANIFEST}) nor a directory of checkpoints")
        if (path / MANIFEST).is_file():
            _require(os.access(path / MANIFEST, os.R_OK), "resume", f"{path / MANIFEST} is not readable")
    if cfg.init_from is not None:
        path = Path(str(cfg.init_from)).expanduser()
        _require(path.exists(), "init_from", f"{cfg.init_from} does not exist")
        hf_model = (path / "config.json").is_file() and any(path.glob("*.safetensors"))
        _require((path / MANIFEST).is_file() or hf_model, "init_from",
                 f"{cfg.init_from} is neither a checkpoint ({MANIFEST}) nor a Hugging Face model directory "
                 "(config.json + *.safetensors)")
        _require(os.access(path, os.R_OK), "init_from", f"{cfg.init_from} is not readable")


def _validate_callbacks(cfg: DictConfig) -> None:
    """Each callback class checks its options before launch (`Callback.check_config`, a no-op by default),
    then what it requires of the other callbacks (`Callback.requires`) must be implemented by exactly one
    of them."""
    from hydra.utils import get_object

    from trainer.callback import Callback

    classes: dict[str, type[Callback]] = {}
    for name, node in cfg.callbacks.items():
        callback_class = get_object(node._target_)
        _require(isinstance(callback_class, type) and issubclass(callback_class, Callback),
                 f"callbacks.{name}._target_",
                 f"'{node._target_}' is not a callback class (a subclass of trainer.callback.Callback)")
        try:
            callback_class.check_config(node)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"callbacks.{name}", str(error).splitlines()[0]) from None
        classes[str(name)] = callback_class
    for name, callback_class in classes.items():
        for requirement in callback_class.requires(cfg.callbacks[name]):
            implementations = [f"callbacks.{other}" for other, other_class in classes.items()
                               if issubclass(other_class, requirement.interface)]
            problem = requirement.problem(implementations)
            _require(problem is None, f"callbacks.{name}", str(problem))


def _validate_data(cfg: DictConfig) -> None:
    """The token sources exist, their indexes are well formed, weights and vocabularies agree with each
    other and with the model (trainer.data.check_data reads headers, and each token file's largest id once:
    it is cached beside the files). A plan reads no data."""
    if cfg.mode == "plan":
        return
    from trainer.data.stdlib_corpus import StdlibCorpus

    _require(not (cfg.data.document_masking and _is_source(cfg.data, StdlibCorpus)),
             "data.document_masking", "data=stdlib has no document boundaries (no end-of-document token): use "
             "data=token_file with a corpus prepared with --append-eos, or data=megatron / nanogpt / mixture")
    from trainer.data import DataSourceError, check_data

    try:
        check_data(cfg.data, int(cfg.model.vocab_size), int(cfg.trainer.seq_len))
    except DataSourceError as error:
        raise ConfigError(error.key, error.message) from None


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError for the first inconsistency of a composed config."""
    _validate_known_keys(cfg)
    _validate_complete(cfg)
    _require(cfg.mode in MODES, "mode", f"'{cfg.mode}' is not one of {', '.join(MODES)}")
    _validate_plan(cfg)
    _validate_trainer(cfg.trainer)
    _validate_targets(cfg)
    _validate_parallel_shortcuts(cfg)
    # Each plugin is built once, when its checks come (the first failing check names its group).
    device_type = _checked_device_type(cfg)
    strategy = _instantiate_plugin(cfg, "strategy")
    _validate_strategy(cfg, strategy, device_type)
    precision = _instantiate_plugin(cfg, "precision")
    _validate_precision(precision, strategy, device_type)
    problem = precision.tensor_parallel_problem() if int(cfg.tp) > 1 else None
    _require(problem is None, "precision", f"{problem} (tp={cfg.tp})")
    _validate_batch(cfg)
    _validate_model(cfg, strategy)
    policy = _instantiate_plugin(cfg, "activation_checkpointing")
    _validate_activation_checkpointing(cfg, policy, strategy)
    _validate_expert_overlap(cfg, policy, strategy)
    _validate_optimization(cfg)
    _validate_qk_clip(cfg, precision, strategy)
    _validate_callbacks(cfg)
    _validate_resume(cfg)
    if cfg.mode != "plan":  # a plan reads no data
        _validate_data_paths(cfg)
    _validate_data(cfg)
