"""`plan.search=true`: enumerate the ways to run the same model and batch on the same machines.

The space, for the configured world size W, hardware and global batch:
- tp: divisors of W up to the devices per node that split the model (what the model's family says tp must
  divide, `ModelFamily.tensor_parallel_sizes`, and the sequence, as the tp strategy requires);
- pp: divisors of W / tp up to the number of layers, with at least pp micro-batches per step;
- cp: divisors of W / (tp pp) up to 64 that cut the sequence into 2 x cp chunks (ring attention with
  causal load balancing, the method the search assumes; cp=1 always);
- dp = W / (tp pp cp), dividing the global batch; its flavour ddp, zero1, zero2, zero3, and zero3 with CPU
  offload on GPUs (sharding over dp x cp);
- pipeline schedule: 1F1B, and interleaved 1F1B with 2 virtual stages where the layers allow;
- activation checkpointing: none, attention, selective, every_n (n=2), full;
- micro-batch: powers of two dividing the per-rank batch.

Each candidate is estimated analytically (no model is built), those that do not fit are dropped, the rest
ranked by estimated tokens/s (ties: less memory). The best are checked by composing and validating their
overrides exactly as `python -m trainer` would, and only valid ones are returned, with the command line.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Iterable, Iterator, Optional, Sequence

from omegaconf import DictConfig

from trainer.planner.estimate import PlanOptions, RankEstimate, Suggestion, evaluate, fits, usable_bytes
from trainer.planner.hardware import HardwareConfig
from trainer.planner.layout import Layout
from trainer.planner.memory import GB
from trainer.planner.params import ModelInventory

log = logging.getLogger("trainer")
FLAVOURS = ("ddp", "zero1", "zero2", "zero3", "zero3_offload")
POLICIES = ("none", "attention", "selective", "every_n", "full")
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
MAX_CP = 64
MAX_REJECTED = 50


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_ok(tp_sizes: Sequence[int], tp: int, seq_len: int) -> bool:
    return tp == 1 or all(size % tp == 0 for size in (*tp_sizes, seq_len))


def family_tp_sizes(cfg: DictConfig) -> list[int]:
    """The sizes tensor parallelism must divide in the configured model (its family's declaration)."""
    from trainer.models import family_of
    from trainer.planner.layout import model_config

    model_cfg = model_config(cfg)
    return [size for _, size, _ in family_of(model_cfg).tensor_parallel_sizes(model_cfg)]


def _cp_sizes(seq_len: int, ranks: int) -> list[int]:
    return [cp for cp in _divisors(ranks) if cp <= MAX_CP and seq_len % (2 * cp) == 0]


def candidate_layouts(inv: ModelInventory, base: Layout, hardware: HardwareConfig,
                      tp_sizes: Sequence[int]) -> Iterator[Layout]:
    """Every layout of the space above; `tp_sizes`: `family_tp_sizes`."""
    world, batch = base.world_size, base.global_batch_size
    for tp, pp, cp in ((tp, pp, cp) for tp in _divisors(world) for pp in _divisors(world // tp)
                       for cp in _cp_sizes(base.seq_len, world // (tp * pp))):
        if tp > hardware.devices_per_node or not _tp_ok(tp_sizes, tp, base.seq_len // cp) or pp > inv.n_layers:
            continue
        dp = world // (tp * pp * cp)
        if batch % dp:
            continue
        # cp ranks are data-parallel ranks for the weights: a flavour reduces (and may shard) over dp x cp;
        # tp or pp alone with cp average the gradients over the cp ranks themselves ("none")
        if dp * cp == 1:
            flavours: tuple[str, ...] = ("none",)
        elif dp == 1 and (tp > 1) != (pp > 1):
            flavours = ("none", *FLAVOURS)
        else:
            flavours = FLAVOURS
        schedules: list[tuple[str, int]] = [("1f1b", 1)]
        if pp > 1 and inv.n_layers >= 2 * pp:
            schedules.append(("interleaved_1f1b", 2))
        if pp == 1:
            schedules = [(base.schedule, 1)]
        for flavour, (schedule, virtual), policy, micro in itertools.product(flavours, schedules, POLICIES,
                                                                             MICRO_BATCHES):
            if (batch // dp) % micro:
                continue
            m = batch // (dp * micro)
            if pp > 1 and m < pp:
                continue
            if schedule == "interleaved_1f1b" and m % max(1, m // pp):
                continue
            if flavour == "zero2" and (tp > 1 or pp > 1):
                continue  # 3d offers FSDP2's shard_grad_op, not textbook ZeRO-2
            offload = flavour == "zero3_offload"
            if offload and hardware.device_type == "cpu":
                continue
            dp_flavour = "zero3" if offload else flavour
            for ep in _ep_sizes(inv, dp * cp, tp, pp, dp_flavour, offload):
                yield base.replace(
                    dp_replicate=dp if dp_flavour in ("ddp", "zero1", "zero2") else 1,
                    dp_shard=dp if dp_flavour == "zero3" else 1,
                    tp=tp, pp=pp, cp=cp, cp_method="ring", dp_flavour=dp_flavour, offload=offload,
                    reshard_after_forward=True, schedule=schedule, virtual_stages=virtual,
                    layers_per_stage=None, checkpointing=policy, checkpoint_every_n=2 if policy == "every_n" else 1,
                    micro_batch_size=micro, strategy=_strategy_name(dp_flavour, dp, tp, pp, cp),
                    comm_hook="none", ep=ep,
                )


def _ep_sizes(inv: ModelInventory, ranks: int, tp: int, pp: int, flavour: str, offload: bool) -> list[int]:
    """Expert-parallel sizes worth trying: 1, and for an MoE under a data-parallel flavour that splits
    experts (ddp, zero1, zero2, zero3; with tp or pp through 3d), every divisor of n_experts that divides
    the dp x cp ranks."""
    del tp, pp  # 3d splits experts under tensor and pipeline parallelism too
    if not inv.n_experts or offload or flavour not in ("ddp", "zero1", "zero2", "zero3"):
        return [1]
    return [ep for ep in _divisors(inv.n_experts) if ranks % ep == 0]


def _strategy_name(flavour: str, dp: int, tp: int, pp: int, cp: int = 1) -> str:
    if tp == 1 and pp == 1:
        return flavour if dp * cp > 1 else "single"
    if flavour == "none" and (tp == 1 or pp == 1):
        return "tp" if pp == 1 else "pp"
    return "3d"


def layout_overrides(layout: Layout) -> list[str]:
    """The command-line overrides that select `layout` (strategy, sizes, policy, micro-batch).

    Every option the search varies is set explicitly, so that values a recipe put into the strategy node
    (its sharding, offload, schedule...) cannot leak into the suggested strategy.
    """
    out = [f"strategy={layout.strategy}", f"tp={layout.tp}", f"pp={layout.pp}", f"cp={layout.cp}", f"ep={layout.ep}"]
    if layout.cp > 1:
        out.append(f"cp_method={layout.cp_method}")
    if layout.strategy == "zero3":
        out.append("strategy.sharding=full_shard")
    if layout.strategy == "3d":
        out.append(f"strategy.data_parallel={layout.dp_flavour if layout.dp_flavour != 'none' else 'fsdp'}")
    if layout.strategy in ("pp", "3d"):
        out += [f"strategy.schedule={layout.schedule}", f"strategy.virtual_stages={layout.virtual_stages}"]
    if layout.strategy in ("ddp", "zero1", "zero2", "zero3", "3d"):
        flag = str(layout.offload).lower()  # every data-parallel strategy has the options (some refuse True)
        out += [f"strategy.offload_params={flag}", f"strategy.offload_optimizer={flag}"]
    out.append(f"activation_checkpointing={layout.checkpointing}")
    if layout.checkpointing == "every_n":
        out.append(f"activation_checkpointing.n={layout.checkpoint_every_n}")
    out.append(f"trainer.micro_batch_size={layout.micro_batch_size}")
    return out


def describe(layout: Layout) -> str:
    parts = [f"dp={layout.dp} ({layout.dp_flavour}{', offload' if layout.offload else ''})", f"tp={layout.tp}",
             f"pp={layout.pp}"]
    if layout.cp > 1:
        parts.append(f"cp={layout.cp} ({layout.cp_method})")
    if layout.ep > 1:
        parts.append(f"ep={layout.ep}")
    if layout.pp > 1:
        parts.append(f"{layout.schedule}{f' v={layout.virtual_stages}' if layout.virtual_stages > 1 else ''}")
    every = f"({layout.checkpoint_every_n})" if layout.checkpointing == "every_n" else ""
    parts.append(f"ckpt={layout.checkpointing}{every}")
    parts.append(f"mb={layout.micro_batch_size}")
    return " ".join(parts)


def rank_candidates(inv: ModelInventory, base: Layout, hardware: HardwareConfig, options: PlanOptions,
                    tp_sizes: Sequence[int], layouts: Optional[Iterable[Layout]] = None
                    ) -> list[tuple[Layout, list[RankEstimate]]]:
    """Every candidate that fits, best estimated throughput first; `layouts`: a part of the space to rank
    (`strategy=auto` ranks the candidates that keep the user's pinned values), default all of it."""
    fitting = []
    for layout in candidate_layouts(inv, base, hardware, tp_sizes) if layouts is None else layouts:
        estimates = evaluate(inv, layout, hardware, options)
        ok, _ = fits(estimates, hardware, options)
        if ok:
            fitting.append((layout, estimates))
    fitting.sort(key=lambda item: (-item[1][0].timing.tokens_per_s, max(e.device["total"] for e in item[1])))
    return fitting


def _validates(cfg: DictConfig, overrides: list[str], base_overrides: list[str]) -> bool:
    from trainer.config import compose, validate

    try:
        # validated as a plan: the checks that concern the planned machine, not this one
        candidate = compose(base_overrides + overrides + ["mode=plan"])
        validate(candidate)
    except Exception as error:  # noqa: BLE001 - any failure means the candidate cannot be used as is
        log.debug(f"search: {' '.join(overrides)} does not validate: {error}")
        return False
    return True


def search_configurations(cfg: DictConfig, inv: ModelInventory, base: Layout, hardware: HardwareConfig,
                          options: PlanOptions, top: int = 5,
                          base_overrides: list[str] | None = None) -> list[Suggestion]:
    """The `top` best configurations that fit and validate."""
    if base_overrides is None:
        base_overrides = config_overrides(cfg)
    suggestions: list[Suggestion] = []
    seen: set[tuple[str, ...]] = set()
    rejected = 0
    for layout, estimates in rank_candidates(inv, base, hardware, options, family_tp_sizes(cfg)):
        overrides = layout_overrides(layout)
        key = tuple(overrides)
        if key in seen:
            continue
        seen.add(key)
        kept = [o for o in base_overrides if not _replaced(o, overrides)]
        if not _validates(cfg, overrides, kept):
            rejected += 1
            if rejected == MAX_REJECTED and not suggestions:
                # composing costs a third of a second: when the base overrides themselves do not validate,
                # every candidate fails alike, so stop instead of composing thousands
                log.warning(f"search: the first {MAX_REJECTED} candidates do not validate with the base "
                            f"overrides {' '.join(base_overrides)}; giving up")
                break
            continue
        worst = max(estimates, key=lambda e: e.device["total"])
        t = estimates[0].timing
        suggestions.append(Suggestion(overrides=kept + overrides, changes=overrides, description=describe(layout),
                                      memory_gb=worst.device["total"] / GB, memory=dict(worst.device),
                                      capacity_bytes=usable_bytes(hardware, options.headroom),
                                      tokens_per_s=t.tokens_per_s,
                                      mfu=t.mfu, step_time_s=t.step_time_s, peak_phase=worst.peak_phase,
                                      at_peak=dict(worst.phases[worst.peak_phase])))
        if len(suggestions) == top:
            break
    return suggestions


def _replaced(override: str, overrides: list[str]) -> bool:
    """Whether a base override gives way to the search's: same key, a sub-key of a group the search picks
    again (the new option's node replaces the old one), or the plan's own options."""
    key = override.split("=", 1)[0].lstrip("+~")
    keys = {o.split("=", 1)[0] for o in overrides}
    if key in keys or key in ("mode", "dp", "cp_method") or key.startswith("plan."):
        return True
    return key.startswith("strategy.") or key.startswith("activation_checkpointing.")


def config_overrides(cfg: DictConfig) -> list[str]:
    """The choices that recreate `cfg`'s model, batch, hardware and precision (what the search keeps fixed):
    taken from Hydra's record of the command line when there is one, else from the config's values."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return [o for o in HydraConfig.get().overrides.task if not o.startswith(("mode=", "plan."))]
    return _value_overrides(cfg)


def _value_overrides(cfg: DictConfig) -> list[str]:
    t = cfg.trainer
    values: dict[str, Any] = {
        "model": cfg.model.name, "precision": _choice(cfg.precision), "hardware": cfg.hardware.name,
        "trainer.devices": t.devices, "trainer.num_nodes": t.num_nodes, "trainer.seq_len": t.seq_len,
        "trainer.global_batch_size": t.global_batch_size,
    }
    return [f"{k}={v}" for k, v in values.items() if v is not None]


def _choice(node: DictConfig) -> str:
    """The option name of a precision node, from its `_target_` class's `name` (declared on the interface)."""
    from hydra.utils import get_class

    return str(get_class(node._target_).name)
