"""The install path: what CI runs is the README's command, and the suite runs on the locked versions.

A fresh clone's `.ci/run` builds a new virtual environment and installs with `-c constraints-cpu.txt`,
which pins the CPU torch and includes `constraints.txt`, the lock of every other dependency. These tests
keep the three files and the README telling the same story, and fail when the environment the suite runs
in is not the one the lock describes (a release that slipped past the lock, or an install without it).
"""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    """`name==version` lines of a constraints file (comments and `-c` includes left out)."""
    found: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            name, _, version = line.partition("==")
            assert version, f"{path.name}: '{line}' is not pinned with =="
            found[canonical(name)] = version
    return found


def direct_dependencies() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["dev"]
    return sorted({canonical(NAME.match(requirement).group(0)) for requirement in requirements})


def readme_test_command() -> str:
    """The README's set-up-and-test command: the second indented line of its opening."""
    opening = (REPO / "README.md").read_text().split("\n## ", 1)[0]
    commands = [line.strip() for line in opening.splitlines() if line.startswith("    ")]
    assert len(commands) == 2, commands  # one to train, one to test
    return commands[1]


def test_ci_runs_the_readme_test_command_in_a_new_environment() -> None:
    command = readme_test_command()
    assert command.startswith("python -m venv ") and command.endswith("python -m pytest -q")
    assert command in (REPO / ".ci" / "run").read_text().splitlines()


def test_cpu_constraints_pin_torch_and_include_the_lock() -> None:
    text = (REPO / "constraints-cpu.txt").read_text()
    assert "-c constraints.txt" in text.splitlines()
    assert pins(REPO / "constraints-cpu.txt") == {"torch": "2.13.0"}
    assert "torch" not in pins(REPO / "constraints.txt")  # a GPU machine keeps its CUDA build


def test_every_direct_dependency_is_locked() -> None:
    locked = pins(REPO / "constraints.txt")
    missing = [name for name in direct_dependencies() if name != "torch" and name not in locked]
    assert not missing, f"not in constraints.txt: {missing}"


def test_the_suite_runs_on_the_locked_versions() -> None:
    locked = pins(REPO / "constraints.txt")
    differ = {name: (metadata.version(name), locked[name]) for name in direct_dependencies()
              if name in locked and metadata.version(name) != locked[name]}
    assert not differ, (f"installed vs constraints.txt: {differ}; install with -c constraints-cpu.txt "
                        "(or regenerate the lock as its header says)")
