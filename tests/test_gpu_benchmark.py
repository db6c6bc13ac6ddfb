"""benchmarks/gpu_throughput.py and benchmarks/gpu_table.py work, on the CPU (not in the gpu tier).

`--smoke` runs the benchmark's whole path (composing model=llama3_8b with overrides, the planner's
estimate, build_trainer, the timed steps, the JSON line) on a 64-wide, 2-layer model in seconds; the table
helper turns that JSON and a junit report into the markdown table docs/BENCHMARKS.md takes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_gpu_throughput_smoke_runs_on_the_cpu_and_ends_with_json(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "benchmarks/gpu_throughput.py", "--smoke"], capture_output=True,
                            text=True, cwd=REPO, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["status"] == "smoke" and data["layers"] == 2 and data["seq_len"] == 64
    assert "model=llama3_8b" in data["overrides"] and "activation_checkpointing=selective" in data["overrides"]
    eager = data["modes"]["eager"]
    assert eager["tokens_per_s"] > 0 and 0 < eager["mfu"] <= 1 and eager["peak_memory_bytes"] > 0
    assert data["torchtitan"]["installed"] in (True, False) and "note" in data["torchtitan"]
    assert "indicative" in data["comparison_note"]

    # the suite's table: one row per test outcome and per benchmark mode
    (tmp_path / "gpu_throughput.json").write_text(result.stdout)
    junit = tmp_path / "junit.xml"
    junit.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="2">'
                     '<testcase classname="tests.test_gpu" name="test_a" time="1.5"/>'
                     '<testcase classname="tests.test_gpu" name="test_b" time="0.0">'
                     '<skipped message="needs a CUDA GPU">skip</skipped></testcase></testsuite></testsuites>')
    table = subprocess.run([sys.executable, "benchmarks/gpu_table.py", "--junit", str(junit),
                            "--throughput", str(tmp_path / "gpu_throughput.json")],
                           capture_output=True, text=True, cwd=REPO, timeout=600)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.strip().splitlines()
    assert lines[0].startswith("| test / benchmark | result | figure |")
    assert any("test_a" in line and "passed" in line for line in lines)
    assert any("test_b" in line and "skipped" in line and "needs a CUDA GPU" in line for line in lines)
    assert any("gpu_throughput eager" in line and "tokens/s" in line for line in lines)
