"""Typed configuration of a run: schemas, the ConfigStore registry, composition and validation.

Where to look:

- `schema.py`: the top-level `Config` and `TrainerConfig`, `SweepConfig`, `PlanConfig`, with every
  default of `trainer.*`, `sweep.*`, `plan.*` and the top-level values (mode, dp, tp, pp, cp, resume,
  init_from);
- `registry.py`: `register_configs`, which stores each family's `SCHEMAS` (option -> dataclass schema,
  exported by trainer.models, trainer.data, trainer.optim, trainer.planner.hardware and the plugin
  packages) as `<group>/<option>_schema`, and the recipes;
- `compose.py`: `compose` (conf/ + overrides outside a Hydra app), `group_options`,
  `describe_compose_error`;
- `validation.py`: `validate`, what a type cannot express (sizes, batch arithmetic, each plugin's rules);
- `derived.py`: `total_steps`, `world_size`, `data_parallel_size`, ... of a composed config;
- `errors.py`: `ConfigError`, the one-line error every check raises;
- `paths.py`: `CONF_DIR`, `RECIPES_DIR`.

Everything is re-exported here, so `from trainer.config import compose, validate` keeps working; modules
of the core that must not import the plugins (the training loop) import from `schema`/`derived` directly.
"""

from __future__ import annotations

from trainer.config.compose import compose, describe_compose_error, group_options
from trainer.config.derived import (
    data_parallel_size,
    gradient_accumulation_steps,
    strategy_class,
    tokens_per_step,
    total_steps,
    world_size,
)
from trainer.config.errors import ConfigError, DoesNotFitError
from trainer.config.paths import CONF_DIR, RECIPES_DIR
from trainer.config.registry import register_configs
from trainer.config.schema import ACCELERATORS, MODES, PLAN_FORMATS, Config, PlanConfig, SweepConfig, TrainerConfig
from trainer.config.validation import validate

__all__ = [
    "ACCELERATORS", "CONF_DIR", "MODES", "PLAN_FORMATS", "RECIPES_DIR",
    "Config", "ConfigError", "DoesNotFitError", "PlanConfig", "SweepConfig", "TrainerConfig",
    "compose", "data_parallel_size", "describe_compose_error", "gradient_accumulation_steps", "group_options",
    "register_configs", "strategy_class", "tokens_per_step", "total_steps", "validate", "world_size",
]
