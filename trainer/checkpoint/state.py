"""What a checkpoint holds, as one flat DCP state dict, and how it goes back into a running trainer.

Keys (all tensors keyed by the parameter's fully qualified name in the unwrapped, unsplit model, so a
checkpoint reshards onto any strategy and world size):

- `model.<fqn>`: weights, from `get_model_state_dict` of each model part (DTensor shards under
  FSDP/TP, plain tensors otherwise; a pipeline stage holds the keys of its own layers);
- `optim.<fqn>.<state>`: optimizer states (Adam's exp_avg, exp_avg_sq, step), in the layout of the
  parameter they belong to (ZeRO-1's Shard(0) views are DTensors of the whole parameter);
- `optim.<fqn>.master_weight`: the fp32 copy the optimizer steps in the parameter's place, when the
  precision plugin keeps one (bf16_true), resharded like the states, so that a resume continues from
  the masters' sub-ulp progress rather than from the rounded weights;
- `trainer`: one packed object (step and token counters, validation history, the data loader's
  position, the LR schedule, the precision plugin's loss scaler, every callback's state), the same on
  every rank;
- `rng.<rank>`: each rank's torch / CUDA / Python / NumPy generator states.

DCP writes each key once: a rank writes its shards, replicated values are written by one rank.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from trainer.checkpoint.storage import pack, unpack
from trainer.memory import storage_address

if TYPE_CHECKING:
    from trainer.callback import Callback
    from trainer.loop import Trainer

log = logging.getLogger("trainer")

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."
# The name of a precision plugin's fp32 master copy among a parameter's optimizer states.
MASTER_WEIGHT = "master_weight"
TRAINER_KEY = "trainer"
RNG_PREFIX = "rng."
# Module attributes that wrap a module without being part of its parameters' names: activation
# checkpointing, torch.compile, FSDP1 (DDP's "module." is handled separately).
_WRAPPER_ATOMS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


# ---- names --------------------------------------------------------------------------------------------
def canonical_name(name: str, root: nn.Module) -> str:
    """The name `root.named_parameters()` gives a parameter, without the wrappers' attributes: the name
    it has in the plain model (what `get_model_state_dict` calls it)."""
    atoms = name.split(".")
    if isinstance(root, DistributedDataParallel) and atoms and atoms[0] == "module":
        atoms = atoms[1:]
    return ".".join(atom for atom in atoms if atom not in _WRAPPER_ATOMS)


def callback_state_keys(callbacks: Sequence["Callback"]) -> list[str]:
    """A stable key per callback: its `state_key` (by default its class's qualified name, as Lightning
    does); a second instance with the same key gets `#1`, a third `#2`..."""
    seen: Counter[str] = Counter()
    keys = []
    for callback in callbacks:
        base = callback.state_key
        keys.append(base if seen[base] == 0 else f"{base}#{seen[base]}")
        seen[base] += 1
    return keys


def model_config_dict(trainer: "Trainer") -> dict[str, Any] | None:
    """The model's architecture (its config dataclass), read from the first model part."""
    config = getattr(trainer.strategy.unwrap(trainer.model_parts[0]), "config", None)
    if config is None or not dataclasses.is_dataclass(config):
        return None
    return {"class": type(config).__name__, **dataclasses.asdict(config)}


# Fields that change tensor shapes: a checkpoint loads only into a model that agrees on all of them
# (Llama's max_seq_len only sizes the RoPE table, which is not saved; GPT's sizes its position embedding).
ARCHITECTURE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim",
                       "multiple_of", "ffn_dim_multiplier", "tie_embeddings", "bias", "n_experts",
                       "moe_hidden_dim", "n_shared_experts",
                       # Qwen3: a head width of its own, q/k/v/o biases, which layers are MoE
                       "head_dim", "attention_bias", "decoder_sparse_step", "mlp_only_layers",
                       # DeepSeek-V3 (MLA widths, where the MoE layers start)
                       "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                       "first_k_dense_replace")
POSITION_TABLE_FAMILIES = ("GPTConfig",)


def architecture_mismatch(saved: dict[str, Any] | None, current: dict[str, Any] | None) -> list[str]:
    """`key: saved vs current` for every shape-determining field the two model configs disagree on."""
    if not saved or not current:
        return []
    problems = []
    if saved.get("class") != current.get("class"):
        problems.append(f"model family {saved.get('class')} vs {current.get('class')}")
    fields = ARCHITECTURE_FIELDS + (("max_seq_len",) if current.get("class") in POSITION_TABLE_FAMILIES else ())
    for key in fields:
        if key in saved and key in current and saved[key] != current[key]:
            problems.append(f"model.{key}={saved[key]} vs {current[key]}")
    return problems


# ---- model --------------------------------------------------------------------------------------------
def model_state(model_parts: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """Every part's weights by FQN (sharded parts give their shards, as DTensors)."""
    state: dict[str, torch.Tensor] = {}
    for part in model_parts:
        state.update(get_model_state_dict(part))
    return state


def load_model_state(model_parts: Sequence[nn.Module], state: dict[str, torch.Tensor]) -> None:
    """Put loaded weights (in each part's own layout) back into the parts."""
    for part in model_parts:
        keys = get_model_state_dict(part).keys()
        set_model_state_dict(part, {key: state[key] for key in keys})


# ---- optimizer ----------------------------------------------------------------------------------------
@dataclass
class OptimizerEntry:
    """One tensor the optimizer steps and the model parameter its states are named after."""

    fqn: str
    stepped: torch.Tensor  # the parameter itself, or a stand-in (ZeRO-1 Shard(0) view, fp32 master copy)
    param: torch.Tensor

    @property
    def master_copy(self) -> bool:
        """Whether the optimizer steps a copy with storage of its own (an fp32 master weight) rather than
        the parameter or a view of its rows."""
        return storage_address(self.stepped) != storage_address(self.param)

    @property
    def reshaped(self) -> bool:
        """A stand-in whose global shape is not the parameter's (a ZeRO-1 view of a tensor-parallel shard
        describes the local TP shard): its states are saved in the parameter's layout instead."""
        return self.stepped is not self.param and tuple(self.stepped.shape) != tuple(self.param.shape)


def optimizer_entries(trainer: "Trainer") -> list[OptimizerEntry]:
    """Every tensor the optimizer steps, named after the model parameter it stands for.

    The optimizer may step stand-ins rather than parameters: ZeRO-1's Shard(0) views (the strategy's
    `optimizer_tensor_pairs()`), fp32 master copies (the precision plugin's). Either exposes
    `optimizer_tensor_pairs() -> [(what it stands for, what the optimizer steps)]`; chains are followed.
    """
    names: dict[int, str] = {}
    for part in trainer.model_parts:
        for name, param in part.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), canonical_name(name, part))
    stands_for: dict[int, torch.Tensor] = {}
    for provider in (trainer.strategy, trainer.precision):
        for original, stand_in in provider.optimizer_tensor_pairs():
            stands_for[id(stand_in)] = original
    entries = []
    for group in trainer.optimizer.param_groups:
        for stepped in group["params"]:
            param = stepped
            while id(param) in stands_for:
                param = stands_for[id(param)]
            if id(param) not in names:
                raise RuntimeError("the optimizer steps a tensor that is neither a parameter of the model parts nor "
                                   "a stand-in declared by the strategy's or precision plugin's "
                                   "`optimizer_tensor_pairs()`, so its state cannot be named in a checkpoint")
            entries.append(OptimizerEntry(names[id(param)], stepped, param))
    return entries


def initialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's states (lazily made by its first step) so a checkpoint can load into them.

    Steps once with zero gradients and a zero learning rate, which leaves the parameters unchanged;
    the states it creates are then overwritten by the checkpoint's (as `torch.distributed.checkpoint`'s
    own `set_optimizer_state_dict` does).
    """
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    lrs = [group["lr"] for group in optimizer.param_groups]
    for param in params:
        param.grad = torch.zeros_like(param)
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for param in params:
        param.grad = None


def _param_layout(state: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A ZeRO-1 view's state gathered over the data-parallel ranks, laid out like its parameter."""
    full_local = state.full_tensor() if isinstance(state, DTensor) else state
    assert isinstance(param, DTensor)
    return DTensor.from_local(full_local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def optimizer_state(entries: Iterable[OptimizerEntry], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for entry in entries:
        if entry.master_copy:
            master = entry.stepped.detach()
            state[f"{OPTIM_PREFIX}{entry.fqn}.{MASTER_WEIGHT}"] = (_param_layout(master, entry.param)
                                                                   if entry.reshaped else master)
        for name, value in optimizer.state.get(entry.stepped, {}).items():
            key = f"{OPTIM_PREFIX}{entry.fqn}.{name}"
            if isinstance(value, torch.Tensor):
                state[key] = _param_layout(value, entry.param) if entry.reshaped and value.dim() else value
            else:
                state[key] = pack(value)
    return state


def optimizer_template(entries: Sequence[OptimizerEntry], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Tensors to load the optimizer states into: the live states themselves (loaded in place), or for a
    resharded ZeRO-1 view a buffer in the parameter's layout."""
    template: dict[str, Any] = {}
    for entry in entries:
        if entry.master_copy:  # loaded in place into the live master, or into a parameter-layout buffer
            template[f"{OPTIM_PREFIX}{entry.fqn}.{MASTER_WEIGHT}"] = (
                torch.zeros_like(entry.param, dtype=entry.stepped.dtype) if entry.reshaped else entry.stepped.detach())
        for name, value in optimizer.state[entry.stepped].items():
            key = f"{OPTIM_PREFIX}{entry.fqn}.{name}"
            if isinstance(value, torch.Tensor):
                reshaped = entry.reshaped and value.dim()
                template[key] = torch.zeros_like(entry.param, dtype=value.dtype) if reshaped else value
            else:
                template[key] = b""
    return template


@torch.no_grad()
def load_optimizer_state(entries: Sequence[OptimizerEntry], optimizer: torch.optim.Optimizer,
                         loaded: dict[str, Any]) -> None:
    """Finish what loading in place left: non-tensor states, and ZeRO-1 rows out of the parameter layout."""
    from trainer.parallel_dims import shard_rows

    for entry in entries:
        master = loaded.get(f"{OPTIM_PREFIX}{entry.fqn}.{MASTER_WEIGHT}")
        if entry.master_copy and entry.reshaped and master is not None:
            full_local = master.to_local() if isinstance(master, DTensor) else master
            stepped = entry.stepped
            mesh = stepped.device_mesh
            stepped.to_local().copy_(shard_rows(full_local, mesh.get_local_rank(), mesh.size()))
        states = optimizer.state[entry.stepped]
        for name, value in list(states.items()):
            loaded_value = loaded[f"{OPTIM_PREFIX}{entry.fqn}.{name}"]
            if not isinstance(value, torch.Tensor):
                states[name] = unpack(loaded_value)
            elif loaded_value is not value:  # a parameter-layout buffer: keep this rank's rows
                full_local = loaded_value.to_local() if isinstance(loaded_value, DTensor) else loaded_value
                mesh = value.device_mesh
                value.to_local().copy_(shard_rows(full_local, mesh.get_local_rank(), mesh.size()))


# ---- everything else ----------------------------------------------------------------------------------
def scheduler_state(scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    # The schedule function itself comes from the run's config, not the checkpoint.
    return {key: value for key, value in scheduler.state_dict().items() if key != "lr_lambdas"}


def load_scheduler_state(scheduler: torch.optim.lr_scheduler.LRScheduler, optimizer: torch.optim.Optimizer,
                         state: dict[str, Any]) -> None:
    current = scheduler.state_dict()
    merged = {**current, **state}
    if "lr_lambdas" in current:
        merged["lr_lambdas"] = [None] * len(current["lr_lambdas"])  # keep this run's schedule functions
    scheduler.load_state_dict(merged)
    # LRScheduler.load_state_dict restores the schedule's position but not the optimizer's current LR,
    # which the next step uses: it is the schedule's last computed LR.
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr


def rng_state() -> dict[str, Any]:
    """This process's random generators, as plain values and tensors (weights_only-loadable)."""
    name, keys, position, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), int(position), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def load_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trainer_state(trainer: "Trainer") -> dict[str, Any]:
    """The non-tensor state of the run, the same on every rank."""
    keys = callback_state_keys(trainer.callbacks)
    return {
        "trainer": trainer.state_dict(),
        "scheduler": scheduler_state(trainer.scheduler),
        "precision": trainer.precision.state_dict(),
        "callbacks": {key: callback.state_dict() for key, callback in zip(keys, trainer.callbacks)},
    }


def load_trainer_state(trainer: "Trainer", state: dict[str, Any]) -> None:
    trainer.load_state_dict(state["trainer"])
    load_scheduler_state(trainer.scheduler, trainer.optimizer, state["scheduler"])
    trainer.precision.load_state_dict(state.get("precision", {}))
    saved = state.get("callbacks", {})
    keys = callback_state_keys(trainer.callbacks)
    for key, callback in zip(keys, trainer.callbacks):
        if key in saved:
            callback.load_state_dict(saved[key])
    unknown = sorted(key for key, value in saved.items() if key not in keys and value)
    if unknown and trainer.is_global_zero:
        log.warning(f"checkpoint holds the state of callbacks this run does not have: {', '.join(unknown)}")
