"""The GPU suite's scripts work, on the CPU (not in the gpu tier): benchmarks/gpu_throughput.py,
gpu_memory.py and hf_reference.py in their `--smoke` modes, and gpu_table.py turning what they print (and a
junit report) into the suite's one markdown table and one JSON object.

`--smoke` runs each benchmark's whole path (composing model=llama3_8b with overrides, the planner's
estimate, build_trainer, the timed steps, the JSON line) on a 64-wide, 2-layer model in seconds.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch_pool import POOL

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # end to end: three benchmark processes

# The three smoke runs are a job started with the shared launches (tests/launch_pool.py): they run beside
# the other tests, each benchmark's output in its own file of RESULTS, as the suite names them.
RESULTS = POOL.jobs_root / "gpu_benchmark"
POOL.add_job("gpu_benchmark", ["bash", "-c", f"""set -e
rm -rf {RESULTS} && mkdir -p {RESULTS}
export OMP_NUM_THREADS=1
{sys.executable} benchmarks/gpu_throughput.py --smoke > {RESULTS}/throughput_bf16.log
{sys.executable} benchmarks/hf_reference.py --smoke > {RESULTS}/hf_4l.log
{sys.executable} benchmarks/gpu_memory.py --smoke --layers 1 --ac none,full --json {RESULTS}/memory.json
"""])


def test_the_suite_benchmarks_run_on_the_cpu_and_make_one_table(tmp_path: Path) -> None:
    code, output = POOL.job("gpu_benchmark")
    assert code == 0, output[-5000:]
    for name in ("throughput_bf16.log", "hf_4l.log", "memory.json"):
        shutil.copy(RESULTS / name, tmp_path / name)
    data = json.loads((tmp_path / "throughput_bf16.log").read_text().strip().splitlines()[-1])
    assert data["status"] == "smoke" and data["layers"] == 2 and data["seq_len"] == 64
    assert "model=llama3_8b" in data["overrides"] and "activation_checkpointing=selective" in data["overrides"]
    eager = data["modes"]["eager"]
    assert eager["tokens_per_s"] > 0 and eager["mfu"] > 0 and eager["peak_memory_bytes"] > 0
    assert data["torchtitan"]["installed"] in (True, False) and "note" in data["torchtitan"]
    assert "indicative" in data["comparison_note"]
    junit = tmp_path / "junit.xml"
    junit.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="2">'
                     '<testcase classname="tests.test_gpu" name="test_a" time="1.5"/>'
                     '<testcase classname="tests.test_gpu" name="test_b" time="0.0">'
                     '<skipped message="needs a CUDA GPU">skip</skipped></testcase></testsuite></testsuites>')

    table = subprocess.run([sys.executable, "benchmarks/gpu_table.py", str(tmp_path)],
                           capture_output=True, text=True, cwd=REPO, timeout=600)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.strip().splitlines()
    assert lines == (tmp_path / "table.md").read_text().strip().splitlines()
    assert lines[0].startswith("| test / benchmark | result | figure |")
    assert any("test_a" in line and "passed" in line for line in lines)
    assert any("test_b" in line and "skipped" in line and "needs a CUDA GPU" in line for line in lines)
    assert any("gpu_throughput bf16 eager" in line and "tokens/s" in line for line in lines)
    assert any("Hugging Face" in line and "tokens/s" in line for line in lines)
    assert sum("planner memory, 1 layers" in line for line in lines) == 2  # AC none and full
    # parts that did not run are rows that say so, not silence
    assert any("fp8" in line and "not run" in line for line in lines)
    assert any("llama2_7b_1xh100_offload" in line and "not run" in line for line in lines)
    suite = json.loads((tmp_path / "suite.json").read_text())
    assert suite["throughput_bf16"]["status"] == "smoke" and len(suite["memory"]["rows"]) == 2
    assert suite["offload"] is None and len(suite["rows"]) == len(lines) - 2
