"""Every `python -m trainer ...` command in the README composes and validates.

This keeps the README from drifting away from the config in a second: a renamed option or group makes
it fail with the README line that broke. tests/test_readme_runs.py runs every README command with tiny
settings (or names the test that does).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from trainer.config import compose, validate

README = Path(__file__).resolve().parent.parent / "README.md"
# Arguments that name things only the reader has (paths of earlier runs, data files, elided options); a
# command's data sources are opened by tests/test_readme_runs.py, which makes them.
PLACEHOLDER = re.compile(r"^(resume|init_from)=|^\.\.\.$|^hydra[./]|^--cfg$|^job$|^-m$|^data[.=]")


def readme_commands() -> list[str]:
    commands, in_block = [], False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            in_block = not in_block
        elif in_block or line.startswith("    "):
            command = line.strip().split(" #", 1)[0].strip()
            if command.startswith("python -m trainer") and not command.startswith("python -m trainer."):
                commands.append(command)
    return commands


def overrides_of(command: str) -> list[str]:
    """The Hydra overrides of a README command; a sweep's comma list contributes its first value."""
    args = shlex.split(command.replace("\\", " "))[3:]
    overrides = []
    for arg in args:
        if PLACEHOLDER.search(arg):
            continue
        key, _, value = arg.partition("=")
        if "," in value and not value.startswith("["):
            value = value.split(",", 1)[0]
        overrides.append(f"{key}={value}")
    return overrides


def test_readme_has_commands() -> None:
    assert len(readme_commands()) >= 30


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_composes_and_validates(command: str) -> None:
    overrides = overrides_of(command)
    if "strategy=auto" in overrides:  # settled by the CLI before composing: the concrete command it makes
        from trainer.planner.auto import settle

        # ranked on the `hardware` group's figures (a run would calibrate this machine first)
        overrides = settle([*overrides, "plan.auto_calibrate=false"]).overrides()
    cfg = compose(overrides)
    validate(cfg)
