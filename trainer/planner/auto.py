"""`strategy=auto`: the fastest layout that fits, chosen before anything is built, with the reason.

The user writes `strategy=auto` and leaves `tp`, `pp`, `cp`, `ep`, `dp`, `activation_checkpointing` and
`trainer.micro_batch_size` out (or sets them to `auto`), or pins some of them. Settling it turns the
command line into a concrete one, the same way `grad_sync=auto` is settled before the strategy is built
(trainer/run.py), one step earlier: here nothing has been composed as a run yet, and what comes back is
overrides, from which the run composes, validates and instantiates the concrete config as any other.

1. The request (`parse_request`): the user's overrides split into what the search keeps fixed (model,
   batch, precision, optimizer, devices, hardware), the pins, and Hydra's own options.
2. The hardware: `mode=plan` plans for the `hardware` group and `trainer.devices x trainer.num_nodes`
   (a 64-GPU job sized on a laptop); a run plans for this machine: its memory per process
   (`accumulation.this_machine`, or `hardware.memory_gb` when the user set it: a budget) and its calibrated
   speed (trainer/planner/profiles.py: measured once per machine and torch version by a short calibration
   run, then read from the cache; `plan.auto_calibrate=false` ranks on the `hardware` group's figures).
3. The candidates: plan.search's space (`search.candidate_layouts`), those keeping the pins, ranked by
   `search.rank_candidates` (estimated tokens/s among those that fit with `plan.headroom`); the best are
   composed and validated with `search.layout_overrides`, the first that validates runs, the next is the
   runner-up. With `plan.trials=K` the best predicted of each of the K best predicted parallel layouts
   (`parallel_layout`) go to the workers, which measure each for a few steps and run the fastest
   (trainer/planner/trials.py).
4. An impossible pin is one line naming the constraint that fails and the nearest layout that fits.

The launcher process decides (one process, so every rank gets the same layout); the choice is recorded
under `auto` in the run's config.yaml (`AutoChoice.record`), and a later run of the same command in the
same run directory (resume=auto) reuses the recorded layout without searching.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
import yaml
from omegaconf import DictConfig

from trainer.config import ConfigError, DoesNotFitError, compose, validate, world_size
from trainer.planner.accumulation import this_machine
from trainer.planner.core import hardware_from_config
from trainer.planner.estimate import PlanOptions, evaluate, fits, usable_bytes
from trainer.planner.hardware import HardwareConfig
from trainer.planner.layout import Layout, layout_from_config, model_config
from trainer.planner.memory import GB
from trainer.planner.params import ModelInventory, inventory
from trainer.planner.profiles import CachedProfile, cache_directory, load_profile, machine_key, store_profile
from trainer.planner.search import (MICRO_BATCHES, POLICIES, candidate_layouts, describe, family_tp_sizes,
                                    layout_overrides, rank_candidates)

log = logging.getLogger("trainer")

# The values the search chooses, and the Layout field each pins.
SEARCHED = {"tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "dp": "dp",
            "activation_checkpointing": "checkpointing", "trainer.micro_batch_size": "micro_batch_size"}
AUTO = "auto"
# Candidates composed and validated before giving up (the base overrides themselves may not validate).
MAX_REJECTED = 20
# The choice `python -m trainer` settled before Hydra composed the concrete config (trainer.cli.settle_auto),
# for the Hydra task of the same process to log and record in config.yaml.
PENDING: Optional[AutoChoice] = None
# Steps of the calibration a run makes when this machine has no cached profile (after 2 warm-up steps).
CALIBRATION_STEPS = 3


def _key_value(override: str) -> tuple[str, str]:
    key, _, value = override.lstrip("+~").partition("=")
    return key, value


def requested(overrides: Iterable[str]) -> bool:
    """Whether the command line asks for `strategy=auto`."""
    return any(_key_value(o) == ("strategy", AUTO) for o in overrides)


@dataclass(frozen=True)
class Request:
    """A `strategy=auto` command line, taken apart."""

    base: tuple[str, ...]  # what the search keeps fixed: model, batch, precision, devices, hardware, ...
    hydra: tuple[str, ...]  # hydra.* options: passed to the run untouched
    pins: dict[str, Any]  # SEARCHED key -> pinned value (int, or the checkpointing policy's name)
    after: tuple[str, ...] = ()  # options of a pinned checkpointing policy (activation_checkpointing.n=3)
    cp_method: Optional[str] = None  # a pinned cp_method applies to the candidates that use cp
    mode: Optional[str] = None  # mode=... as given (train when left out)

    def pin_text(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.pins.items())

    def sets(self, key: str) -> bool:
        """Whether the user set `key` (a base override)."""
        return any(_key_value(o)[0] == key for o in self.base)


def parse_request(overrides: Iterable[str]) -> Request:
    """Split a `strategy=auto` command line (ConfigError for what auto cannot honour)."""
    base, hydra, after = [], [], []
    pins: dict[str, Any] = {}
    cp_method = mode = None
    for override in overrides:
        key, value = _key_value(override)
        if key.startswith("hydra.") or key.startswith("hydra/"):
            hydra.append(override)
        elif key == "strategy":
            if value != AUTO:
                raise ConfigError("strategy", f"strategy=auto and strategy={value} both given: keep one")
        elif key in SEARCHED:
            if value == AUTO:
                continue
            if key == "activation_checkpointing":
                pins[key] = value
            else:
                try:
                    pins[key] = int(value)
                except ValueError:
                    raise ConfigError(key, f"must be a positive integer or auto, got {value!r}") from None
                if pins[key] < 1:
                    raise ConfigError(key, f"must be a positive integer or auto, got {value!r}")
        elif key.startswith("activation_checkpointing."):
            after.append(override)
        elif key.startswith("strategy."):
            raise ConfigError(key, "strategy=auto chooses the strategy and its options; pin tp, pp, cp, ep, dp, "
                                   "activation_checkpointing or trainer.micro_batch_size, or name a strategy")
        elif key == "cp_method":  # the candidates' layout overrides name it when they use cp
            cp_method = value
        elif key == "mode":
            mode = value
        else:
            base.append(override)
    if after and "activation_checkpointing" not in pins:
        raise ConfigError(_key_value(after[0])[0], "set only with a pinned policy "
                                                   "(activation_checkpointing=NAME): strategy=auto picks the policy")
    return Request(tuple(base), tuple(hydra), pins, tuple(after), cp_method, mode)


def concrete_overrides(base: Iterable[str], layout: Iterable[str], after: Iterable[str],
                       mode: Optional[str] = None) -> list[str]:
    """The command line of one layout: the fixed part, the layout, the pinned policy's options it does not
    set itself, and the mode (each key once: Hydra refuses a key given twice)."""
    layout = list(layout)
    keys = {_key_value(o)[0] for o in layout}
    rest = [o for o in after if _key_value(o)[0] not in keys]
    return [*base, *layout, *rest, *([f"mode={mode}"] if mode else [])]


@dataclass
class AutoChoice:
    """What `strategy=auto` chose, and why: logged, and written into the run's config.yaml (`record`)."""

    request: Request
    layout_overrides: list[str]  # the concrete layout (strategy, sizes, policy, micro-batch)
    chosen: str  # the layout in words (search.describe)
    reason: str
    predicted_step_time_s: float
    predicted_memory_gb: float  # the most loaded rank's peak
    capacity_gb: float  # usable memory per rank the choice was made against
    profile: str  # the hardware profile ranked on
    fitting: int  # layouts that fit and keep the pins
    runner_up: Optional[str] = None
    runner_up_overrides: Optional[list[str]] = None
    runner_up_step_time_s: Optional[float] = None
    # plan.trials: the candidates the workers measure (the chosen one first), their words and predictions
    trials: list[list[str]] = field(default_factory=list)
    trial_descriptions: list[str] = field(default_factory=list)
    trial_predicted_s: list[float] = field(default_factory=list)
    measured_s: Optional[dict[str, float]] = None  # per trial description: the median step time measured
    reused_from: Optional[str] = None  # the config.yaml a rerun took the layout from (no search)

    def overrides(self) -> list[str]:
        """The concrete command line (without Hydra's options)."""
        return concrete_overrides(self.request.base, self.layout_overrides, self.request.after, self.request.mode)

    def command_line(self) -> list[str]:
        return [*self.request.hydra, *self.overrides()]

    def record(self) -> dict[str, Any]:
        """The `auto` node of config.yaml: enough to rerun or resume without searching again."""
        return {"overrides": list(self.layout_overrides), "base_overrides": list(self.request.base),
                "after": list(self.request.after), "pins": dict(self.request.pins), "chosen": self.chosen,
                "runner_up": self.runner_up, "runner_up_overrides": self.runner_up_overrides,
                "reason": self.reason, "predicted_step_time_s": self.predicted_step_time_s,
                "runner_up_predicted_step_time_s": self.runner_up_step_time_s,
                "predicted_memory_gb": self.predicted_memory_gb, "capacity_gb": self.capacity_gb,
                "profile": self.profile, "fitting_layouts": self.fitting, "trials": [list(t) for t in self.trials],
                "trial_descriptions": list(self.trial_descriptions),
                "trial_predicted_step_time_s": list(self.trial_predicted_s), "measured_step_time_s": self.measured_s,
                "reused_from": self.reused_from}

    def lines(self) -> list[str]:
        """The log lines: the pick, the runner-up and the reason, the command that reruns it."""
        out = [f"strategy=auto -> {' '.join(self.layout_overrides)}",
               f"strategy=auto: chosen {self.chosen}; {self.reason}"]
        if self.runner_up is not None:
            out.append(f"strategy=auto: runner-up {self.runner_up}")
        return out


# ----------------------------------------------------------------------------------------------------------
# The candidates


def _matches(layout: Layout, pins: dict[str, Any]) -> bool:
    return all(getattr(layout, SEARCHED[key]) == value for key, value in pins.items())


def _space(inv: ModelInventory, base: Layout, hardware: HardwareConfig, tp_sizes: list[int],
           request: Request) -> list[Layout]:
    """plan.search's candidates, with what the user pinned outside the search's own values applied: a
    checkpointing policy it does not vary (offload) replaces `none`, a cp_method other than ring."""
    policy = request.pins.get("activation_checkpointing")
    out = []
    for layout in candidate_layouts(inv, base, hardware, tp_sizes):
        if policy is not None and policy not in POLICIES:
            if layout.checkpointing != "none":
                continue
            layout = layout.replace(checkpointing=str(policy))
        if request.cp_method is not None and layout.cp > 1:
            layout = layout.replace(cp_method=request.cp_method)
        every = [int(v) for k, v in map(_key_value, request.after) if k == "activation_checkpointing.n"]
        if policy == "every_n" and every:
            layout = layout.replace(checkpoint_every_n=every[-1])
        out.append(layout)
    return out


def _explain_pin(key: str, value: Any, inv: ModelInventory, base: Layout, hardware: HardwareConfig,
                 tp_sizes: list[int]) -> str:
    """Why no layout of the space has `key=value`: the constraint it breaks, in words."""
    world, batch = base.world_size, base.global_batch_size
    if key == "tp":
        return (f"tp={value}: tp must divide the {world} processes, be at most {hardware.devices_per_node} (devices "
                f"per node) and divide the model's sizes {sorted(set(tp_sizes))} and the sequence "
                f"({base.seq_len} tokens)")
    if key == "pp":
        return (f"pp={value}: pp must divide the {world} processes / tp, be at most the {inv.n_layers} layers and have "
                f"at least pp micro-batches per step")
    if key == "cp":
        return (f"cp={value}: cp must divide the {world} processes / (tp x pp) and cut trainer.seq_len={base.seq_len} "
                f"into 2 x cp chunks")
    if key == "ep":
        if not inv.n_experts:
            return f"ep={value}: the model has no experts (model.n_experts=0)"
        return (f"ep={value}: ep must divide model.n_experts={inv.n_experts} and the dp x cp ranks of a "
                f"data-parallel flavour that splits experts")
    if key == "dp":
        return (f"dp={value}: dp = {world} processes / (tp x pp x cp) must divide "
                f"trainer.global_batch_size={batch}")
    if key == "trainer.micro_batch_size":
        return (f"trainer.micro_batch_size={value}: must be one of {', '.join(map(str, MICRO_BATCHES))} and divide "
                f"the per-rank batch trainer.global_batch_size / dp")
    return f"{key}={value}: not one of the policies {', '.join(POLICIES)}"


def _nearest(fitting: list[tuple[Layout, list[Any]]], pins: dict[str, Any]) -> Optional[Layout]:
    """The fitting layout that keeps the most pins, the fastest of those (`fitting` is ranked)."""
    if not fitting:
        return None
    return min((layout for layout, _ in fitting),
               key=lambda layout: sum(getattr(layout, SEARCHED[k]) != v for k, v in pins.items()))


def _impossible(request: Request, inv: ModelInventory, base: Layout, hardware: HardwareConfig,
                options: PlanOptions, tp_sizes: list[int], space: list[Layout]) -> ConfigError:
    """The one line for pins no fitting layout keeps: the constraint that fails, the nearest layout that fits."""
    pins = request.pins
    matching = [layout for layout in space if _matches(layout, pins)]
    if not matching:
        alone = [k for k in pins if not any(_matches(layout, {k: pins[k]}) for layout in space)]
        if alone:
            constraint = _explain_pin(alone[0], pins[alone[0]], inv, base, hardware, tp_sizes)
        else:
            constraint = (f"{request.pin_text()}: no layout of {base.world_size} processes has these together "
                          f"(dp x tp x pp x cp = {base.world_size}, dp dividing the global batch)")
    else:
        smallest = min(matching, key=lambda layout: max(e.device["total"] for e in evaluate(inv, layout, hardware,
                                                                                             options)))
        _, short = fits(evaluate(inv, smallest, hardware, options), hardware, options)
        what = short[0] if short else "it does not fit"
        constraint = f"{request.pin_text()}: no layout keeping them fits; the smallest ({describe(smallest)}) {what}"
    fitting = sorted(rank_candidates(inv, base, hardware, options, tp_sizes, space), key=_run_preference)
    nearest = _nearest(fitting, pins)
    suggestion = (f"nearest layout that fits: {' '.join(layout_overrides(nearest))} ({describe(nearest)})"
                  if nearest is not None else "no layout of this world size fits at all")
    return ConfigError("strategy=auto", f"{constraint}; {suggestion}")


def validation_error(request: Request, overrides: list[str], mode: str) -> Optional[str]:
    """Why the layout's command line does not validate (the first line), None when it does."""
    try:
        validate(compose(concrete_overrides(request.base, overrides, request.after, mode)))
    except Exception as error:  # noqa: BLE001 - any failure means the candidate cannot be used as is
        log.debug(f"strategy=auto: {' '.join(overrides)} does not validate: {error}")
        return str(error).splitlines()[0] if str(error).strip() else type(error).__name__
    return None


def validates(request: Request, overrides: list[str], mode: str) -> bool:
    return validation_error(request, overrides, mode) is None


def ranked_layouts(request: Request, hardware: HardwareConfig, options: PlanOptions
                   ) -> tuple[ModelInventory, Layout, list[int], list[Layout], list[tuple[Layout, list[Any]]]]:
    """The request's model, its base layout, the sizes tp must divide, the whole candidate space, and the
    candidates that keep the pins and fit, best predicted first (`search.rank_candidates`)."""
    planned = compose([*request.base, "mode=plan"])
    inv = inventory(model_config(planned))
    base = layout_from_config(planned)
    tp_sizes = family_tp_sizes(planned)
    space = _space(inv, base, hardware, tp_sizes, request)
    kept = [layout for layout in space if _matches(layout, request.pins)]
    ranked = rank_candidates(inv, base, hardware, options, tp_sizes, kept)
    return inv, base, tp_sizes, space, sorted(ranked, key=_run_preference)


# Among layouts predicted equally fast, the one that recomputes least: the time model charges a policy its
# recompute FLOPs only, not the checkpointing wrappers' own cost, which is not small on a CPU (measured on
# 2 gloo processes, tiny model: selective 1.36 s per step vs none 0.81 s, both predicted 0.41 s).
# plan.search breaks such ties by memory; a run that fits either way wants the speed.
RECOMPUTE_ORDER = ("none", "attention", "selective", "every_n", "full", "offload")
TIE = 0.005  # predicted step times within 0.5% are equal


def _run_preference(item: tuple[Layout, list[Any]]) -> tuple[int, int, float]:
    layout, estimates = item
    step = estimates[0].timing.step_time_s
    policy = RECOMPUTE_ORDER.index(layout.checkpointing) if layout.checkpointing in RECOMPUTE_ORDER else 0
    return round(math.log(max(step, 1e-12)) / math.log1p(TIE)), policy, max(e.device["total"] for e in estimates)


def parallel_layout(layout: Layout) -> tuple[Any, ...]:
    """What `plan.trials` keeps apart: the strategy and the sizes and flavours of the parallel dimensions
    (not the micro-batch size or the checkpointing policy)."""
    return (layout.strategy, layout.tp, layout.pp, layout.cp, layout.ep, layout.dp_flavour, layout.schedule,
            layout.virtual_stages, layout.cp_method if layout.cp > 1 else None)


def choose(request: Request, hardware: HardwareConfig, options: PlanOptions, *, mode: str, trials: int = 0,
           profile: str = "") -> AutoChoice:
    """The layout to run: the fastest predicted that fits, keeps the pins and validates (and with `trials`
    the K best, for the workers to measure). A function of its arguments only: the same request, hardware
    and options give the same choice."""
    inv, base, tp_sizes, space, ranked = ranked_layouts(request, hardware, options)
    picked: list[tuple[Layout, list[Any], list[str]]] = []  # validated, best predicted first: run, runner-up
    # The trials: the best predicted of each of the `trials` best predicted parallel layouts. The time model's
    # errors are largest between parallel layouts (measured on a 2-core CPU: tp and ep far slower than
    # predicted, pipelines faster), so measuring K of them finds more than measuring one layout K times at
    # micro-batch sizes and checkpointing policies the model already ranks within a few percent.
    trial_picks: list[tuple[Layout, list[Any], list[str]]] = []
    groups: set[tuple[Any, ...]] = set()
    seen: set[tuple[str, ...]] = set()
    rejected, first_error = 0, ""
    for layout, estimates in ranked:
        overrides = layout_overrides(layout)
        group = parallel_layout(layout)
        if tuple(overrides) in seen or (len(picked) >= 2 and group in groups):
            continue
        seen.add(tuple(overrides))
        error = validation_error(request, overrides, mode)
        if error is not None:
            first_error = first_error or f"{' '.join(overrides)}: {error}"
            rejected += 1
            if rejected >= MAX_REJECTED and not picked:
                break
            continue
        if len(picked) < 2:
            picked.append((layout, estimates, overrides))
        if group not in groups and len(trial_picks) < trials:
            groups.add(group)
            trial_picks.append((layout, estimates, overrides))
        if len(picked) >= 2 and len(trial_picks) >= trials:
            break
    if not picked:
        if ranked:  # layouts fit, keeping the pins, but their command lines do not validate
            kept = f" and keep {request.pin_text()}" if request.pins else ""
            raise ConfigError("strategy=auto", f"none of the {len(ranked)} layouts that fit{kept} validates (the "
                                               f"first tried, {first_error})")
        if request.pins:
            raise _impossible(request, inv, base, hardware, options, tp_sizes, space)
        smallest = min(space, key=lambda layout: max(e.device["total"] for e in evaluate(inv, layout, hardware,
                                                                                          options)))
        _, short = fits(evaluate(inv, smallest, hardware, options), hardware, options)
        raise DoesNotFitError(f"strategy=auto: no layout of {base.world_size} processes fits; the smallest "
                              f"({describe(smallest)}): {short[0] if short else 'does not fit'}")
    layout, estimates, overrides = picked[0]
    step = estimates[0].timing.step_time_s
    memory = max(e.device["total"] for e in estimates) / GB
    capacity = usable_bytes(hardware, options.headroom) / GB
    pinned = f", keeping {request.pin_text()}" if request.pins else ""
    reason = (f"the fastest predicted of {len(ranked)} layouts that fit {base.world_size} process(es){pinned}: "
              f"{step * 1e3:.1f} ms per step, {memory:.3f} of {capacity:.3f} GB per rank ({profile})")
    choice = AutoChoice(request=request, layout_overrides=overrides, chosen=describe(layout), reason=reason,
                        predicted_step_time_s=step, predicted_memory_gb=memory, capacity_gb=capacity,
                        profile=profile, fitting=len(ranked))
    if len(picked) > 1:
        second, second_estimates, second_overrides = picked[1]
        second_step = second_estimates[0].timing.step_time_s
        choice.runner_up, choice.runner_up_overrides = describe(second), second_overrides
        choice.runner_up_step_time_s = second_step
        choice.reason += f"; runner-up {second_step * 1e3:.1f} ms ({second_step / step - 1:+.1%})"
    if trials > 0:
        chosen = trial_picks
        choice.trials = [o for _, _, o in chosen]
        choice.trial_descriptions = [describe(lay) for lay, _, _ in chosen]
        choice.trial_predicted_s = [e[0].timing.step_time_s for _, e, _ in chosen]
    return choice


# ----------------------------------------------------------------------------------------------------------
# The hardware a choice is made for


def plan_options(cfg: DictConfig, profile: Optional[CachedProfile] = None) -> PlanOptions:
    """`plan.*`'s estimate options, with a calibrated profile's measured efficiencies."""
    options = PlanOptions.of(cfg)
    if profile is not None:
        options = dataclasses.replace(options, matmul_efficiency=profile.matmul_efficiency,
                                      attention_efficiency=profile.attention_efficiency)
    return options


def machine_hardware(cfg: DictConfig, request: Request, base: HardwareConfig) -> HardwareConfig:
    """`base` (a calibrated profile or the `hardware` group) with this machine's memory per process: the
    device's, or on a CPU the host's share of each local process; `hardware.memory_gb` (and
    `hardware.reserved_gb`) set on the command line are a budget that replaces it."""
    device = torch.device("cuda" if cfg.trainer.accelerator != "cpu" and torch.cuda.is_available() else "cpu")
    hardware = this_machine(base, device, int(cfg.trainer.devices))
    given = hardware_from_config(cfg)
    for key in ("memory_gb", "reserved_gb"):
        if request.sets(f"hardware.{key}"):
            hardware = dataclasses.replace(hardware, **{key: getattr(given, key)})
    return hardware


RunOnWorkers = Callable[[DictConfig, Path, Callable[[DictConfig, Path], Any]], None]


def calibrate_this_machine(request: Request, cfg: DictConfig, directory: Path, key: dict[str, Any],
                           run_on_workers: RunOnWorkers) -> CachedProfile:
    """Measure this machine once (plan.calibrate's run of the layout the `hardware` group's figures pick) and
    cache the profile."""
    import json
    import time

    from trainer.planner.calibrate import compare, run_config
    from trainer.planner.calibration_run import MEASURED_FILE, calibration_worker

    rough = machine_hardware(cfg, request, hardware_from_config(cfg))
    first = choose(request, rough, plan_options(cfg), mode="train", profile="the hardware group's figures")
    overrides = [*concrete_overrides(request.base, first.layout_overrides, request.after, "plan"),
                 "plan.calibrate=true", "plan.calibrate_warmup=2", f"plan.calibrate_steps={CALIBRATION_STEPS}"]
    planned = compose(overrides)
    run_dir = directory / f"calibration-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    log.info(f"strategy=auto: no calibrated profile of this machine in {directory}; measuring it once with "
             f"{' '.join(first.layout_overrides)} ({CALIBRATION_STEPS} steps)")
    run_on_workers(run_config(planned), run_dir, calibration_worker)
    result = compare(planned, json.loads((run_dir / MEASURED_FILE).read_text()))
    hardware = HardwareConfig(**result["hardware"])
    source = "python -m trainer " + " ".join(overrides)
    path = store_profile(directory, key, hardware, result["matmul_efficiency"], result["attention_efficiency"], source)
    return CachedProfile(hardware, result["matmul_efficiency"], result["attention_efficiency"], path, source)


def profile_for_run(request: Request, cfg: DictConfig,
                    run_on_workers: Optional[RunOnWorkers]) -> tuple[HardwareConfig, PlanOptions, str]:
    """The hardware, estimate options and their description a run of this machine ranks on."""
    if not cfg.plan.auto_calibrate:
        return (machine_hardware(cfg, request, hardware_from_config(cfg)), plan_options(cfg),
                f"hardware={cfg.hardware.name}'s figures, this machine's memory")
    device_type = "cuda" if cfg.trainer.accelerator != "cpu" and torch.cuda.is_available() else "cpu"
    key = machine_key(device_type, int(cfg.trainer.devices))
    directory = cache_directory(cfg.plan.profile_dir)
    profile = load_profile(directory, key)
    if profile is None:
        if run_on_workers is None:
            raise ConfigError("plan.auto_calibrate", f"no calibrated profile of this machine in {directory} and no "
                                                     "way to measure it here; set plan.auto_calibrate=false")
        profile = calibrate_this_machine(request, cfg, directory, key, run_on_workers)
    memory = " (memory budget hardware.memory_gb)" if request.sets("hardware.memory_gb") else ""
    return (machine_hardware(cfg, request, profile.hardware), plan_options(cfg, profile),
            f"calibrated profile {profile.path}{memory}")


# ----------------------------------------------------------------------------------------------------------
# Settling a command line


def recorded_choice(run_dir: Optional[Path]) -> Optional[dict[str, Any]]:
    """The `auto` record of an earlier run in `run_dir` (its config.yaml), None when there is none."""
    if run_dir is None:
        return None
    path = run_dir / "config.yaml"
    try:
        record = (yaml.safe_load(path.read_text()) or {}).get("auto")
    except (OSError, yaml.YAMLError):
        return None
    return record if isinstance(record, dict) and record.get("overrides") else None


# Options a rerun may change and still run the recorded layout: they do not enter the choice.
RERUN_FREE = ("trainer.max_steps", "trainer.max_tokens", "trainer.val_every", "trainer.val_batches",
              "trainer.log_every", "trainer.save_final", "trainer.preflight", "trainer.hang_", "trainer.straggler_", "resume", "init_from",
              "callbacks", "logger", "plan.")


def _same_request(request: Request, record: dict[str, Any]) -> bool:
    """Whether `record` was chosen for what `request` asks (the same fixed part and pins, up to RERUN_FREE)."""
    def fixed(base: Iterable[str]) -> list[str]:
        return sorted(o for o in base if not _key_value(o)[0].startswith(RERUN_FREE))

    return (fixed(record.get("base_overrides") or []) == fixed(request.base)
            and dict(record.get("pins") or {}) == dict(request.pins))


def reuse(request: Request, record: dict[str, Any], path: Path) -> AutoChoice:
    """The recorded choice of an earlier run, as this run's (no search)."""
    measured = record.get("measured_step_time_s")
    reason = str(record["reason"]) if record.get("reused_from") else \
        f"the layout recorded in {path} (no search); it was {record['reason']}"
    return AutoChoice(request=request, layout_overrides=list(record["overrides"]), chosen=str(record["chosen"]),
                      reason=reason,
                      predicted_step_time_s=float(record["predicted_step_time_s"]),
                      predicted_memory_gb=float(record["predicted_memory_gb"]),
                      capacity_gb=float(record["capacity_gb"]), profile=str(record["profile"]),
                      fitting=int(record["fitting_layouts"]), runner_up=record.get("runner_up"),
                      runner_up_overrides=record.get("runner_up_overrides"),
                      runner_up_step_time_s=record.get("runner_up_predicted_step_time_s"),
                      measured_s=dict(measured) if measured else None, reused_from=str(path))


def settle(overrides: list[str], run_dir: Optional[Path] = None,
           run_on_workers: Optional[RunOnWorkers] = None) -> AutoChoice:
    """The concrete choice for a `strategy=auto` command line: the one recorded in `run_dir` when an earlier
    run there made it (unless resume=none), else a new one for the planned or this machine."""
    request = parse_request(overrides)
    cfg = compose([*request.base, "mode=plan"])  # the fixed part, planned: every option's value
    mode = request.mode or "train"
    recorded = recorded_choice(run_dir) if mode == "train" and str(cfg.resume) != "none" else None
    if recorded is not None and _same_request(request, recorded):
        assert run_dir is not None
        return reuse(request, recorded, run_dir / "config.yaml")
    if recorded is not None:
        log.warning(f"strategy=auto: {run_dir}/config.yaml records a choice for other options "
                    f"({' '.join(recorded.get('base_overrides') or [])}): choosing again")
    if mode == "plan":
        hardware = hardware_from_config(cfg)
        nodes = int(cfg.trainer.num_nodes)
        return choose(request, hardware, plan_options(cfg), mode=mode,
                      profile=f"hardware={hardware.name}, {world_size(cfg)} devices on {nodes} node(s)")
    hardware, options, profile = profile_for_run(request, cfg, run_on_workers)
    return choose(request, hardware, options, mode=mode, trials=int(cfg.plan.trials), profile=profile)
