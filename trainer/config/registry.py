"""Hydra's ConfigStore: every family's schemas, the top-level schema and the recipes.

Each config family exports `SCHEMAS: dict[str, type]`, option name -> dataclass schema, next to its
classes; `register_configs` stores every entry as `<group>/<name>_schema`, which `conf/<group>/*.yaml`
names first in its defaults list. Adding an option to a family therefore needs its class, its schema in
that family's SCHEMAS and a YAML file; nothing here changes. recipes/*.yaml are stored as the `recipe`
group (`recipe=NAME`).

The families are imported when `register_configs` runs, not when this module is imported, so that
importing trainer.config stays cheap and imports no plugin.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from trainer.config.paths import RECIPES_DIR
from trainer.config.schema import Config


class Family(NamedTuple):
    """One config group and where its schemas come from."""

    group: str
    schemas: dict[str, type]
    # Options are stored under their own key inside the group's node (`logger.csv`, `callbacks.memory`),
    # so that several of them compose side by side (`logger=[csv,wandb]`).
    keyed: bool = False


def families() -> list[Family]:
    """The config groups and their families' SCHEMAS (imports the families)."""
    from trainer.data import SCHEMAS as DATA_SCHEMAS
    from trainer.models import SCHEMAS as MODEL_SCHEMAS
    from trainer.plugins.optimizers import SCHEMAS as OPTIMIZER_SCHEMAS
    from trainer.planner.hardware import SCHEMAS as HARDWARE_SCHEMAS
    from trainer.plugins.activation_checkpointing import SCHEMAS as ACTIVATION_CHECKPOINTING_SCHEMAS
    from trainer.plugins.callbacks import SCHEMAS as CALLBACK_SCHEMAS
    from trainer.plugins.loggers import SCHEMAS as LOGGER_SCHEMAS
    from trainer.plugins.lr_schedules import SCHEMAS as LR_SCHEDULE_SCHEMAS
    from trainer.plugins.precision import SCHEMAS as PRECISION_SCHEMAS
    from trainer.plugins.strategies import SCHEMAS as STRATEGY_SCHEMAS

    return [
        Family("model", MODEL_SCHEMAS),
        Family("data", DATA_SCHEMAS),
        Family("strategy", STRATEGY_SCHEMAS),
        Family("precision", PRECISION_SCHEMAS),
        Family("activation_checkpointing", ACTIVATION_CHECKPOINTING_SCHEMAS),
        Family("optimizer", OPTIMIZER_SCHEMAS),
        Family("lr_schedule", LR_SCHEDULE_SCHEMAS),
        Family("logger", LOGGER_SCHEMAS, keyed=True),
        Family("callbacks", CALLBACK_SCHEMAS, keyed=True),
        Family("hardware", HARDWARE_SCHEMAS),
    ]


_schemas_stored = False  # once per process: storing every schema costs 80 ms a compose


def _shared_config_store(self: ConfigStore, memo: dict) -> ConfigStore:
    return self


def _share_config_store() -> None:
    """Every compose deep-copies Hydra's config repository (CachingConfigRepository, "to avoid mutating it
    with initialize_sources()"), and with it the ConfigStore singleton its structured-config source holds:
    every schema and recipe, 50 ms of a 0.3 s compose. Nothing writes to the copy (ConfigStore.load hands
    out a deep copy of each node it loads), so the copy is the store itself."""
    ConfigStore.__deepcopy__ = _shared_config_store  # type: ignore[attr-defined]


def register_configs() -> None:
    """Put every schema in Hydra's ConfigStore (idempotent: the schemas once, a recipe when it changed)."""
    global _schemas_stored
    cs = ConfigStore.instance()
    if not _schemas_stored:
        _share_config_store()
        cs.store(name="config_schema", node=Config)
        for family in families():
            for name, node in family.schemas.items():
                package = f"{family.group}.{name}" if family.keyed else None
                cs.store(group=family.group, name=f"{name}_schema", node=node, package=package)
        _schemas_stored = True
    _register_recipes(cs)


def stored_nodes() -> list[object]:
    """Every config node in Hydra's ConfigStore now (a node stored again is a new object)."""
    nodes: list[object] = []
    pending = [ConfigStore.instance().repo]
    while pending:
        for item in pending.pop().values():
            if isinstance(item, dict):
                pending.append(item)
            else:
                nodes.append(item)
    return nodes


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
