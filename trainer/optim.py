"""Optimizer construction: the parameter groups (weight decay, hidden matrices) and the optimizer over them.

The optimizers themselves and their Hydra schemas are plugins (plugins/optimizers/, `optimizer=NAME`).

Users configure ``weight_decay`` as part of the optimizer (``conf/optimizer``),
but it must not apply to every parameter, so the trainer strips it from the
optimizer partial and applies it per group instead::

    optimizer = optimizer_from_config(cfg.optimizer, [model])
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import hydra.utils
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

__all__ = [
    "hidden_matrices",
    "wants_hidden_matrix_group",
    "param_groups",
    "optimizer_param_groups",
    "build_optimizer",
    "optimizer_from_config",
    "optimizer_state_tensors",
    "hidden_matrix_state_tensors",
]

# Embedding tables are lookups, not linear maps: decaying them shrinks rows of
# rare tokens toward zero every step they are not seen.
_EMBEDDING_TYPES: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)


# ---------------------------------------------------------------------------
# Parameter groups
# ---------------------------------------------------------------------------


def _owned_parameters(
    modules: Iterable[nn.Module],
) -> Iterator[tuple[nn.Module, nn.Parameter]]:
    """Yield ``(owning module, parameter)`` in traversal order, duplicates included."""
    for root in modules:
        # Shared parameters are yielded once per owner on purpose: the caller
        # needs every owner to decide whether any of them rules out decay.
        for module in root.modules():
            for param in module.parameters(recurse=False):
                yield module, param


def _excluded_from_decay(module: nn.Module, param: nn.Parameter) -> bool:
    """Whether this ownership alone rules the parameter out of weight decay."""
    # Biases, norm gains and other vectors/scalars are never decayed.
    return param.ndim < 2 or isinstance(module, _EMBEDDING_TYPES)


def _head_weights(roots: Sequence[nn.Module]) -> set[int]:
    """The ids of the output layers' weights among `roots` (a model, its pipeline stages), as their model
    family declares them (`ModelFamily.tied_weights`); none for a module of no family (a test's toy)."""
    from trainer.models import family_of

    heads: set[int] = set()
    for root in roots:
        try:
            family = family_of(root)
        except TypeError:
            continue
        model = root
        while isinstance(getattr(model, "_orig_mod", None) or getattr(model, "module", None), nn.Module):
            model = getattr(model, "_orig_mod", None) or model.module  # DDP / torch.compile wrappers
        head = family.tied_weights(model)[1]
        if head is not None:
            heads.add(id(head))
    return heads


def hidden_matrices(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """The hidden weight matrices of `modules`: what Muon-style optimizers orthogonalise.

    Every trainable parameter with two or more dimensions (a batch of matrices in the last two: a MoE
    layer's experts) except embedding tables (lookups, not linear maps), the output layer (the family's
    head: its rows are per-token logits, which Moonlight and Kimi step with AdamW) and anything sharing a
    parameter with either (a tied head). In traversal order, each once."""
    roots = list(modules)
    heads = _head_weights(roots)
    params: dict[int, nn.Parameter] = {}
    excluded: set[int] = set()
    for module, param in _owned_parameters(roots):
        if not param.requires_grad:
            continue
        params.setdefault(id(param), param)
        if _excluded_from_decay(module, param) or id(param) in heads:
            excluded.add(id(param))
    return [p for key, p in params.items() if key not in excluded]


def param_groups(modules: Iterable[nn.Module], weight_decay: float,
                 hidden_matrix_group: bool = False) -> list[dict[str, Any]]:
    """Split trainable parameters into a weight-decay and a no-decay group (and, when asked, the hidden
    matrices into a group of their own): the one place that decides which parameter gets what.

    No decay: every parameter with fewer than two dimensions (biases,
    LayerNorm/RMSNorm weights, custom scales) and every weight of an
    ``nn.Embedding``/``nn.EmbeddingBag`` (token and learned position tables).
    Decay: every other parameter with two or more dimensions, i.e. the
    weights of ``nn.Linear`` layers (and of other matrix-weight layers).

    A parameter reachable from several places (tied input/output embeddings,
    modules listed twice) appears once, at its first position in traversal
    order; it is excluded from decay if *any* owner excludes it, so a tied
    LM head follows its embedding into ``no_decay``.  Parameters with
    ``requires_grad=False`` are left out.

    With ``hidden_matrix_group`` (an optimizer such as Muon asks for it), the :func:`hidden_matrices`
    leave the decay group for a first group ``{"name": "muon", "use_muon": True}`` with the same decay;
    the output layer stays in "decay".

    Args:
        modules: Modules to collect parameters from, in order.
        weight_decay: Decay coefficient of the "decay" (and "muon") group; must be >= 0.
        hidden_matrix_group: Put the hidden matrices in a group of their own.

    Returns:
        Up to two (three) groups, ``{"name": "decay" | "no_decay", "params": [...],
        "weight_decay": float}``, empty groups dropped.
    """
    if not weight_decay >= 0.0:  # phrased to reject NaN as well
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")

    modules = list(modules)
    # Ordered by first appearance; dicts keep insertion order.
    params: dict[int, nn.Parameter] = {}
    no_decay_ids: set[int] = set()
    for module, param in _owned_parameters(modules):
        if not param.requires_grad:
            continue
        params.setdefault(id(param), param)
        if _excluded_from_decay(module, param):
            no_decay_ids.add(id(param))

    hidden_ids = {id(p) for p in hidden_matrices(modules)} if hidden_matrix_group else set()
    decay = [p for key, p in params.items() if key not in no_decay_ids and key not in hidden_ids]
    no_decay = [p for key, p in params.items() if key in no_decay_ids]
    groups = [
        {"name": "decay", "params": decay, "weight_decay": float(weight_decay)},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
    ]
    if hidden_matrix_group:
        hidden = [p for key, p in params.items() if key in hidden_ids]
        groups.insert(0, {"name": "muon", "params": hidden, "weight_decay": float(weight_decay), "use_muon": True})
    return [group for group in groups if group["params"]]


def wants_hidden_matrix_group(optimizer_factory: Callable[..., Any]) -> bool:
    """Whether the optimizer class behind `optimizer_factory` (a partial of it) steps the hidden matrices as
    a group of their own (its class attribute ``hidden_matrix_group``, e.g. Muon)."""
    target = getattr(optimizer_factory, "func", optimizer_factory)
    return bool(getattr(target, "hidden_matrix_group", False))


def optimizer_param_groups(optimizer_factory: Callable[..., Any], modules: Iterable[nn.Module],
                           weight_decay: float) -> list[dict[str, Any]]:
    """:func:`param_groups` as the optimizer behind `optimizer_factory` wants them (what strategies that
    step stand-ins of the parameters, ZeRO's row views, build their groups from)."""
    return param_groups(modules, weight_decay, hidden_matrix_group=wants_hidden_matrix_group(optimizer_factory))


# ---------------------------------------------------------------------------
# Optimizer construction
# ---------------------------------------------------------------------------


def build_optimizer(
    optimizer_factory: Callable[..., torch.optim.Optimizer],
    modules: Iterable[nn.Module],
    weight_decay: float,
) -> torch.optim.Optimizer:
    """Create an optimizer over :func:`param_groups` of ``modules``.

    Args:
        optimizer_factory: Callable taking the parameter groups, typically a
            Hydra ``_partial_`` of ``torch.optim.AdamW``/``SGD`` that does
            *not* set ``weight_decay``.
        modules: Modules whose trainable parameters are optimized.
        weight_decay: Decay coefficient of the "decay" group.
    """
    # Per-group values would silently override a factory-level weight_decay;
    # refuse it rather than let two settings disagree.
    if isinstance(optimizer_factory, functools.partial) and (
        "weight_decay" in optimizer_factory.keywords
    ):
        raise ValueError(
            "optimizer_factory must not set weight_decay; pass it to build_optimizer instead"
        )
    groups = optimizer_param_groups(optimizer_factory, modules, weight_decay)
    if not groups:
        raise ValueError("no trainable parameters found in the given modules")
    return optimizer_factory(groups)


def _fused_kernel_runs_on(tensors: list[torch.Tensor]) -> bool:
    """Whether torch's fused optimizer kernel takes every tensor in one call: plain floating tensors on a
    device it supports, all plain or all DTensors of one mesh (the kernel is one operator: DTensor refuses
    to mix them, as with tensor parallelism's replicated norms beside its shards, or expert parallelism's
    second mesh). Tensor subclasses (float8's FSDP weights) and meta tensors (the planner's exact mode)
    are left to torch's default implementation."""
    from torch.distributed.tensor import DTensor
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    meshes = {t.device_mesh if isinstance(t, DTensor) else None for t in tensors}
    if len(meshes) > 1:
        return False
    devices = set(_get_fused_kernels_supported_devices())
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if type(local) not in (torch.Tensor, nn.Parameter) or not local.is_floating_point():
            return False
        if local.device.type not in devices:
            return False
    return True


def folds_gradient_scale(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """Whether `optimizer`'s step can scale every gradient it reads inside its own kernel by a factor held
    on `device`: torch's fused kernels (Adam, AdamW, SGD, Adagrad with `fused=True`) divide each gradient
    by the optimizer's `grad_scale` tensor, which `torch.amp.GradScaler` sets to unscale. Only over plain
    tensors on that device: a DTensor step would mix a plain tensor with DTensors in one operator, and a
    step in host memory (ZeRO-Offload) would read a factor copied from the GPU without waiting for it."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    groups = optimizer.param_groups
    return all(group.get("fused") for group in groups) and all(
        type(p) in (torch.Tensor, nn.Parameter) and p.device == device for group in groups for p in group["params"])


class _FusedWhenSupported(functools.partial):
    """``optimizer_class(groups, **options)`` with ``fused=True`` when the kernel takes every tensor of
    ``groups`` (the ``fused: null`` default); a ``functools.partial`` so that callers see its options."""

    def __call__(self, groups: Any, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        groups = list(groups)
        tensors = [p for group in groups for p in (group["params"] if isinstance(group, dict) else [group])]
        if tensors and _fused_kernel_runs_on(tensors):
            kwargs = {**kwargs, "fused": True}
        return super().__call__(groups, *args, **kwargs)


def optimizer_factory_from_config(cfg: DictConfig) -> tuple[functools.partial, float]:
    """The optimizer class bound to its options, and the weight decay of the "decay" group.

    ``weight_decay`` is popped from the config (0.0 if absent) so that it can be applied per group.
    An optimizer with a ``fused`` option left null (and ``foreach`` not set) gets the fused kernel
    wherever it runs (see ``AdamWConfig.fused``).
    """
    # A plain container: structured configs refuse pop() and would hand
    # ListConfig betas to torch.
    options = OmegaConf.to_container(cfg, resolve=True)
    if not isinstance(options, dict):
        raise ValueError(f"optimizer config must be a mapping, got {type(options).__name__}")
    options.pop("defaults", None)
    weight_decay = float(options.pop("weight_decay", 0.0))
    options["_partial_"] = True
    factory = hydra.utils.instantiate(options)
    if "fused" in options and options["fused"] is None and options.get("foreach") is None:
        keywords = {key: value for key, value in factory.keywords.items() if key != "fused"}
        factory = _FusedWhenSupported(factory.func, *factory.args, **keywords)
    return factory, weight_decay


def optimizer_from_config(cfg: DictConfig, modules: Iterable[nn.Module]) -> torch.optim.Optimizer:
    """Build an optimizer from an ``optimizer`` config node (e.g. ``adamw.yaml``)."""
    factory, weight_decay = optimizer_factory_from_config(cfg)
    return build_optimizer(factory, modules, weight_decay)


# What an optimizer whose stand-in step fails is assumed to keep: Adam's two moments, the most of the
# common optimizers, so that the memory plan errs on the safe side.
_ASSUMED_STATE_TENSORS = 2


@functools.lru_cache(maxsize=16)
def _state_tensors_of(options_yaml: str, hidden_matrix: bool = False) -> int | None:
    factory, weight_decay = optimizer_factory_from_config(OmegaConf.create(options_yaml))
    group: dict[str, Any] = {"weight_decay": weight_decay}
    if hidden_matrix:
        if not wants_hidden_matrix_group(factory):
            return None
        group["use_muon"] = True  # the group `param_groups(..., hidden_matrix_group=True)` makes
    # A matrix (optimizers such as Muon refuse vectors) with a gradient: states are created by the first step.
    stand_in = nn.Parameter(torch.zeros(4, 4))
    try:
        optimizer = factory([{**group, "params": [stand_in]}])
        stand_in.grad = torch.ones_like(stand_in)
        optimizer.step()
    except Exception:  # noqa: BLE001 - an optimizer that cannot step on CPU here is planned conservatively
        return _ASSUMED_STATE_TENSORS
    return sum(1 for value in optimizer.state[stand_in].values()
               if isinstance(value, torch.Tensor) and value.shape == stand_in.shape)


def optimizer_state_tensors(cfg: DictConfig) -> int:
    """How many tensors the size of its parameter the configured optimizer keeps for each parameter
    (AdamW: exp_avg and exp_avg_sq, 2; SGD with momentum: 1; plain SGD: 0), for the memory planner; for an
    optimizer that steps the hidden matrices apart (Muon), what it keeps for the other parameters
    (`hidden_matrix_state_tensors` counts the matrices').

    Found by stepping the optimizer once on a small stand-in parameter rather than read from the spelling
    of its `_target_`: any class counts right, also one whose name says nothing (or misleads).
    """
    count = _state_tensors_of(OmegaConf.to_yaml(cfg, resolve=True))
    assert count is not None
    return count


def hidden_matrix_state_tensors(cfg: DictConfig) -> int | None:
    """How many tensors the size of its parameter the configured optimizer keeps for each hidden matrix
    when it steps them as a group of their own (Muon: the momentum buffer, 1), found as
    `optimizer_state_tensors` finds its count; None for an optimizer that treats every parameter alike."""
    return _state_tensors_of(OmegaConf.to_yaml(cfg, resolve=True), True)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _copy_of(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy of `tensor` in `dtype` where it is, in the same DTensor layout."""
    from torch.distributed.tensor import DTensor

    copy = _local(tensor.detach()).to(dtype=dtype, copy=True)
    if isinstance(tensor, DTensor):
        return DTensor.from_local(copy, tensor.device_mesh, tensor.placements, run_check=False,
                                  shape=tensor.shape, stride=tensor.stride())
    return copy


class SteppedCopies:
    """Copies of the tensors an optimizer updates, stepped in their place on the same device: fp32
    master weights of lower-precision parameters (bf16_true). The host-memory variant (ZeRO-Offload) is
    `trainer.offload.HostSteppedCopies`.

    Installed by replacing the optimizer's parameter-group entries before its first step (its state is
    still empty then). Works for whatever tensors the strategy gave the optimizer: parameters, FSDP or
    tensor-parallel DTensor shards, ZeRO's sharded row views. Each step copies the gradients to the
    copies, steps, and writes the results back (rounded to the tensors' dtype).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, dtype: torch.dtype | None = None) -> None:
        if optimizer.state:
            raise RuntimeError("stepped copies must be installed before the optimizer's first step")
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for group in optimizer.param_groups:
            copies = []
            for tensor in group["params"]:
                copy = _copy_of(tensor, dtype or tensor.dtype)
                self.pairs.append((tensor, copy))
                copies.append(copy)
            group["params"] = copies
        self.verify = True  # compare the copies with the tensors at the next step (see `weights_written`)

    def weights_written(self) -> None:
        """The tensors were written from outside (a checkpoint, init_from): check the copies at the next step."""
        self.verify = True

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        for tensor, copy in self.pairs:
            local, local_copy = _local(tensor), _local(copy)
            # A tensor whose value is no longer its copy's rounding was written from outside (init_from,
            # a checkpoint saved without the copies): its copy restarts from it. Local shards only, so no
            # collective is needed (each rank refreshes what it holds).
            if self.verify and not torch.equal(local_copy.to(local.dtype), local):
                local_copy.copy_(local)
            copy.grad = None if tensor.grad is None else _copy_of(tensor.grad, copy.dtype)
        self.verify = False
        optimizer.step()
        for tensor, copy in self.pairs:
            _local(tensor).copy_(_local(copy))  # rounds to the tensor's dtype
            copy.grad = None
