"""Composing conf/ + overrides outside of a Hydra app, and one-line messages for composition errors.

`compose` is what tests, benchmarks, the planner's search and the CLI's preflight use to get the config a
run would get (`python -m trainer` itself composes through Hydra's app, onto the same ConfigStore).
`describe_compose_error` turns Hydra's and OmegaConf's multi-line errors (unknown option, unknown key,
wrong type, unparsable override) into the one line the CLI prints, with the allowed choices.
"""

from __future__ import annotations

import difflib
from typing import Any

from omegaconf import DictConfig

from trainer.config.paths import CONF_DIR, RECIPES_DIR
from trainer.config.registry import register_configs

__all__ = ["CONF_DIR", "RECIPES_DIR", "compose", "describe_compose_error", "group_options"]


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
