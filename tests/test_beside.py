"""tests/beside.py: a test marked `beside` reports, in the session's process, the outcome the second
process recorded for it: a failure fails it (with the second process's text), a skip skips it, a pass passes,
each parametrized case on its own; a session that selects only `beside` tests runs them itself."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROBE = '''
import os
import pytest

SECOND = "TRAINER_TEST_BESIDE_RESULTS" in os.environ


@pytest.mark.beside
def test_passes(tmp_path):
    assert SECOND and tmp_path.exists()


@pytest.mark.beside
def test_fails():
    assert 1 + 1 == 3, "the probe fails"


@pytest.mark.beside
def test_skips():
    pytest.skip("nothing to run here")


@pytest.mark.beside
@pytest.mark.parametrize("case", [1, 2])
def test_param(case):
    assert SECOND and case == 1, f"case {case} fails"


def test_in_the_session():
    assert not SECOND
'''


@pytest.mark.slow
def test_the_session_reports_what_the_second_process_recorded() -> None:
    probe = REPO / "tests" / f"test_probe_{uuid.uuid4().hex[:8]}.py"  # under tests/: the suite's conftest
    probe.write_text(PROBE)
    try:
        env = {key: value for key, value in os.environ.items() if key != "TRAINER_TEST_BESIDE_RESULTS"}
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA",
                                 str(probe.relative_to(REPO))], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=300)
        alone = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                f"{probe.relative_to(REPO)}::test_fails"], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=300)
    finally:
        probe.unlink()
    out = result.stdout
    name = probe.stem
    outcomes = sorted(line.split(" ")[0] + " " + line.split("::")[1].split(" ")[0]
                      for line in out.splitlines() if line.startswith(("PASSED", "FAILED", "SKIPPED", "ERROR"))
                      and "::" in line)
    assert outcomes == ["FAILED test_fails", "FAILED test_param[2]", "PASSED test_in_the_session",
                        "PASSED test_param[1]", "PASSED test_passes"], out
    assert "SKIPPED [1]" in out and "nothing to run here" in out, out
    assert "[beside process, call]" in out and "the probe fails" in out and "case 2 fails" in out, out
    assert "job beside-tests" in out, out  # the second process ran
    assert f"{name}.py" in out and result.returncode == 1
    # only beside tests selected: run in the session's own process (the probe asserts SECOND: it fails there
    # without the second process's text)
    assert "job beside-tests" not in alone.stdout and "[beside process" not in alone.stdout, alone.stdout
    assert "the probe fails" in alone.stdout and alone.returncode == 1
