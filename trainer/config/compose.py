"""Composing conf/ + overrides outside of a Hydra app, and one-line messages for composition errors.

`compose` is what tests, benchmarks, the planner's search and the CLI's preflight use to get the config a
run would get (`python -m trainer` itself composes through Hydra's app, onto the same ConfigStore).
`describe_compose_error` turns Hydra's and OmegaConf's multi-line errors (unknown option, unknown key,
wrong type, unparsable override) into the one line the CLI prints, with the allowed choices.

Composing is Hydra's slowest step (0.26 s on the 2-core machine: the defaults tree, about 35 YAML and
structured configs loaded and merged), and a process composes many configs that differ only in values
(`model.dim=64`, `trainer.max_steps=3`): the planner's search validates candidates, tests and the shared
test launches compose hundreds. So `compose` splits the overrides as Hydra itself applies them: the
defaults list (the group choices and `hydra.*`) is composed by Hydra once per process and kept, and the
value overrides (dotted and top-level) are applied to a deep copy of it with Hydra's own
`ConfigLoaderImpl._apply_overrides_to_config`, in their order, which is what Hydra's composition does
after building the same defaults list (hydra/_internal/config_loader_impl.py). A sweep, a package `@` and
any error are composed whole, so an error reads exactly as Hydra words it.
"""

from __future__ import annotations

import copy
import difflib
import os
from collections import OrderedDict
from typing import Any

from omegaconf import DictConfig

from trainer.config.paths import CONF_DIR, RECIPES_DIR
from trainer.config.registry import register_configs, stored_nodes

__all__ = ["CONF_DIR", "RECIPES_DIR", "compose", "describe_compose_error", "group_options"]


# Composed defaults lists kept per process (module docstring): the fast test tier composes 771 configs
# from 226 defaults lists (most of them differ in the model, the strategy or a recipe).
BASE_CACHE_SIZE = 128
_bases: OrderedDict[tuple[Any, ...], tuple[DictConfig, list[Any]]] = OrderedDict()


def compose(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """Compose conf/ with overrides outside of a Hydra app (tests, benchmarks, the CLI's preflight)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    overrides = list(overrides or [])
    register_configs()
    split = _split_values(overrides)
    if split is not None:
        base, values = split
        try:
            cfg = copy.deepcopy(_base(base, config_name))
            ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
            return cfg
        except Exception:  # noqa: BLE001 - composed whole below, which raises Hydra's own error
            pass
    return _hydra_compose(overrides, config_name)


def _hydra_compose(overrides: list[str], config_name: str) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name=config_name, overrides=overrides)


def _split_values(overrides: list[str]) -> tuple[list[str], list[Any]] | None:
    """(the overrides that make the defaults list: group choices and `hydra...`, the parsed value overrides
    in their order), or None when the overrides must be composed whole (module docstring). Hydra tells them
    apart the same way: an override whose key names a config group chooses an option, any other sets a
    value after the defaults list is composed."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001 - Hydra's composition reports it
        return None
    groups = _groups()
    base: list[str] = []
    values: list[Any] = []
    for override in parsed:
        if override.is_sweep_override() or override.package is not None:
            return None
        key = override.key_or_group
        if override.is_hydra_override() or "/" in key or key in groups:
            base.append(override.input_line)
        else:
            values.append(override)
    return base, values


def _groups() -> set[str]:
    """The top-level config groups: conf/'s directories, the ConfigStore's groups (recipe) and Hydra's."""
    from hydra.core.config_store import ConfigStore

    stored = {name for name, item in ConfigStore.instance().repo.items() if isinstance(item, dict)}
    return {path.name for path in CONF_DIR.iterdir() if path.is_dir()} | stored | {"hydra"}


def _base(base: list[str], config_name: str) -> DictConfig:
    """The composed defaults list of `base` (kept; callers deep-copy it). Kept per the config files' and the
    ConfigStore's state: a file edited or an option stored again composes anew."""
    nodes = stored_nodes()
    key = (config_name, tuple(base), _files_state(), tuple(map(id, nodes)))  # the files' paths name CONF_DIR
    if key in _bases:
        _bases.move_to_end(key)
        return _bases[key][0]
    cfg = _hydra_compose(base, config_name)
    _bases[key] = (cfg, nodes)  # the nodes kept alive, so that their ids are not reused while this is kept
    while len(_bases) > BASE_CACHE_SIZE:
        _bases.popitem(last=False)
    return cfg


def _files_state() -> tuple[tuple[str, int, int], ...]:
    """The config files' names, sizes and modification times."""
    state = []
    for root, _, files in os.walk(CONF_DIR):
        for name in files:
            if name.endswith(".yaml"):
                info = os.stat(os.path.join(root, name))
                state.append((os.path.join(root, name), info.st_size, info.st_mtime_ns))
    return tuple(sorted(state))



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
