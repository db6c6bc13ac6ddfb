"""Every `_target_` of the project is spelled one way, `<package>.<Name>`, and resolves.

A class's public address is the package that exports it (`trainer.plugins.strategies.ZeRO2`,
`trainer.plugins.callbacks.CheckpointManager`, `trainer.models.Llama`), never the file it happens to live
in (`trainer.plugins.strategies.zero2.ZeRO2`): files can then be split or renamed without touching a
config. A top-level module of `trainer` (`trainer.sweep.SweepSummary`) is itself a public address. Targets
of other projects (`torch.optim.AdamW`) only have to resolve.

Checked: the `_target_` of every schema the families register (nested ones included) and of every YAML
file under conf/ and recipes/.
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf

from trainer.config.registry import families

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "trainer"


def module_spelling(target: str) -> Optional[str]:
    """Why `target` names a module of trainer inside a package rather than the package (None if not)."""
    if target.split(".", 1)[0] != PROJECT:
        return None
    module_name, _, name = target.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None  # not a module path at all (a package's attribute, or a typo `spelling_problem` reports)
    parent = module_name.rpartition(".")[0]
    if hasattr(module, "__path__") or parent == PROJECT:  # a package, or a top-level module of trainer
        return None
    exported = name in vars(importlib.import_module(parent))
    advice = f"spell it {parent}.{name}" + ("" if exported else f" and export {name} from {parent}")
    return f"names the module {module_name} instead of its package: {advice}"


def spelling_problem(target: str) -> Optional[str]:
    """Why `target` is not a resolvable, package-level `_target_` (None when it is)."""
    try:
        get_object(target)
    except Exception as error:  # noqa: BLE001 - whatever stops it from importing
        return f"does not resolve ({type(error).__name__}: {' '.join(str(error).split())})"
    return module_spelling(target)


def targets_in(node: Any, where: str) -> Iterator[tuple[str, str]]:
    """(where, target) for every `_target_` in a config tree."""
    if isinstance(node, DictConfig):
        for key in node.keys():
            child = node._get_node(key)
            if key == "_target_":
                yield where, str(node[key])
            elif isinstance(child, (DictConfig, ListConfig)) and not child._is_missing() and not child._is_none():
                yield from targets_in(child, f"{where}.{key}")
    elif isinstance(node, ListConfig):
        for index, child in enumerate(node):
            yield from targets_in(child, f"{where}[{index}]")


def schema_targets() -> list[tuple[str, str]]:
    found = []
    for family in families():
        for name, schema in family.schemas.items():
            assert dataclasses.is_dataclass(schema), (family.group, name)
            found += targets_in(OmegaConf.structured(schema), f"{family.group}/{name}_schema")
    return found


def yaml_targets() -> list[tuple[str, str]]:
    found = []
    for folder in ("conf", "recipes"):
        for path in sorted((ROOT / folder).rglob("*.yaml")):
            found += targets_in(OmegaConf.load(path), str(path.relative_to(ROOT)))
    return found


def test_every_schema_and_yaml_target_is_package_level_and_resolves() -> None:
    targets = schema_targets() + yaml_targets()
    # every family has options, and the walk reaches nested schemas and Hydra's own callbacks
    assert len({where.split("/")[0] for where, _ in targets}) >= 10
    assert ("conf/hydra/callbacks/sweep_summary.yaml.sweep_summary", "trainer.sweep.SweepSummary") in targets
    problems = {f"{where}: {target}": problem for where, target in targets
                if (problem := spelling_problem(target)) is not None}
    assert problems == {}


def test_no_file_spells_a_target_through_a_module() -> None:
    """Tests, docs, README and benchmarks too (they compose configs by hand): any `_target_` naming a
    class of trainer must be spelled at its package (docs may use placeholders: only the spelling is
    checked here, resolving is the runs' business)."""
    import re

    pattern = re.compile(r"""_target_["']?\s*[:=]\s*["']?(trainer\.[A-Za-z0-9_.]+)""")
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for folder in ("trainer", "plugins", "tests", "benchmarks", "conf", "recipes"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".yaml", ".md"))
    problems = {}
    for path in files:
        for match in pattern.finditer(path.read_text()):
            problem = module_spelling(match.group(1))
            if problem is not None:
                problems[f"{path.relative_to(ROOT)}: {match.group(1)}"] = problem
    assert problems == {}


# ---- the checker itself must be able to fail ---------------------------------------------------------------
@pytest.mark.parametrize("target, expected", [
    ("trainer.plugins.strategies.zero2.ZeRO2", "spell it trainer.plugins.strategies.ZeRO2"),
    ("trainer.plugins.callbacks.checkpoint.CheckpointManager", "spell it trainer.plugins.callbacks.CheckpointManager"),
    ("trainer.models.llama.model.Llama", "spell it trainer.models.llama.Llama"),
    # a class its package does not export: the advice says to export it
    ("trainer.plugins.strategies.ddp.ShardedOptimizerStates", "and export ShardedOptimizerStates from"),
    ("trainer.plugins.strategies.ZeRO4", "does not resolve"),
    ("trainer.nothing_here.Class", "does not resolve"),
])
def test_the_checker_refuses_module_paths_and_unresolvable_targets(target: str, expected: str) -> None:
    problem = spelling_problem(target)
    assert problem is not None and expected in problem


@pytest.mark.parametrize("target", ["trainer.plugins.strategies.ZeRO2", "trainer.models.Llama",
                                    "trainer.data.StdlibCorpus", "trainer.plugins.loggers.csv_logger",
                                    "trainer.sweep.SweepSummary", "torch.optim.AdamW"])
def test_the_checker_accepts_package_level_targets(target: str) -> None:
    assert spelling_problem(target) is None


def test_a_schema_spelled_through_its_module_fails_the_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.plugins.strategies import SCHEMAS, ZeRO2Config

    module_spelling = dataclasses.make_dataclass(
        "ZeRO2Config", [("_target_", str, dataclasses.field(default="trainer.plugins.strategies.zero2.ZeRO2"))],
        bases=(ZeRO2Config,))
    monkeypatch.setitem(SCHEMAS, "zero2", module_spelling)
    bad = [(where, target) for where, target in schema_targets() if spelling_problem(target) is not None]
    assert bad == [("strategy/zero2_schema", "trainer.plugins.strategies.zero2.ZeRO2")]
