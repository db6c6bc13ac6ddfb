"""One markdown table of a GPU suite run (benchmarks/gpu_suite.sh), ready for docs/BENCHMARKS.md.

Reads pytest's junit XML of the gpu tier (`--junit`) and the output files of the benchmarks whose last line
is a JSON object (`--throughput` for benchmarks/gpu_throughput.py, `--precision` for
benchmarks/precision_speed.py); any of them may be missing (a step that failed or was not run), and
the table says so. Columns: test / benchmark, result, figure.

    python benchmarks/gpu_table.py --junit out/junit.xml --throughput out/gpu_throughput.log \\
        --precision out/precision_speed.log
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Optional


def last_json(path: Optional[Path]) -> Optional[dict[str, Any]]:
    """The JSON object on the last non-empty line of a benchmark's output, or None."""
    if path is None or not path.is_file():
        return None
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        return None
    try:
        value = json.loads(lines[-1])
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def test_rows(junit: Optional[Path]) -> list[tuple[str, str, str]]:
    """(test id, passed/failed/error/skipped, seconds or the skip/failure message) per test case."""
    if junit is None or not junit.is_file():
        return [("pytest -m gpu", "not run", "no junit report")]
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, figure = "passed", f"{float(case.get('time', 0.0)):.1f} s"
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                figure = (found.get("message") or "").splitlines()[0][:120] if found.get("message") else ""
                break
        rows.append((name, outcome, figure.replace("|", "/")))
    return rows


def throughput_rows(data: Optional[dict[str, Any]]) -> list[tuple[str, str, str]]:
    if data is None:
        return [("gpu_throughput", "not run", "no JSON output")]
    status = str(data.get("status"))
    if status not in ("measured", "smoke"):  # e.g. "no CUDA device": nothing was run
        return [("gpu_throughput", status, f"torchtitan: {data['torchtitan']['note']}")]
    rows = []
    shape = f"{data['layers']} layers of Llama 3 8B width, seq {data['seq_len']}, {data['device']}"
    for mode, figures in data.get("modes", {}).items():
        ratio = figures.get("ratio_to_torchtitan_8xh100")
        rows.append((f"gpu_throughput {mode}", status,
                     f"{figures['tokens_per_s']:,.0f} tokens/s/GPU, MFU {100 * figures['mfu']:.1f}%, peak "
                     f"{figures['peak_memory_bytes'] / 1e9:.1f} GB (planner {data['planner_memory_gb']:.1f} GB); "
                     f"{shape}" + (f"; x{ratio:.2f} of torchtitan's 8-GPU figure (indicative)" if ratio else "")))
    rows.append(("torchtitan", "installed" if data["torchtitan"]["installed"] else "not installed",
                 data["torchtitan"]["note"]))
    return rows


def precision_rows(data: Optional[dict[str, Any]]) -> list[tuple[str, str, str]]:
    if data is None:
        return [("precision_speed", "not run", "no JSON output (no CUDA device, or the run failed)")]
    rows = []
    for name, figures in data.get("precisions", {}).items():
        ratio = figures.get("ratio_to_fp32")
        rows.append((f"precision_speed {name}", "measured",
                     f"{figures['tokens_per_s']:,.0f} tokens/s" + (f", x{ratio:.2f} of fp32" if ratio else "")
                     + f" ({data.get('model', 'tiny')}, {data.get('device', 'cpu')})"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--junit", type=Path, default=None)
    parser.add_argument("--throughput", type=Path, default=None, help="gpu_throughput.py's output")
    parser.add_argument("--precision", type=Path, default=None, help="precision_speed.py's output")
    args = parser.parse_args()
    rows = test_rows(args.junit) + throughput_rows(last_json(args.throughput))
    if args.precision is not None:
        rows += precision_rows(last_json(args.precision))
    print("| test / benchmark | result | figure |")
    print("|---|---|---|")
    for name, outcome, figure in rows:
        print(f"| {name} | {outcome} | {figure} |")


if __name__ == "__main__":
    main()
