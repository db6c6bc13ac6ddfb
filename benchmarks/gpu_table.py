"""One markdown table and one JSON object of a GPU suite run (benchmarks/gpu_suite.sh), for
docs/BENCHMARKS.md's GPU section.

Reads what the suite left in its results folder (any part may be missing: a step that failed, timed out
or was not run, and the table says so):

    junit.xml                   the gpu test tier (pytest -m gpu)
    memory.json                 benchmarks/gpu_memory.py: the planner against the allocator's peak
    throughput_bf16.log         benchmarks/gpu_throughput.py, bf16, the planner's layer count (last line JSON)
    throughput_fp8.log          the same with precision=fp8
    throughput_*_acc8.log       bf16 and fp8 with 8 micro-batches per optimizer step
    throughput_4l.log           4 layers, no activation checkpointing, compiled: this trainer ...
    hf_4l.log                   ... and benchmarks/hf_reference.py's plain Hugging Face loop on the same shape
    offload_run/summary.json    recipe=llama2_7b_1xh100_offload for a few steps (ZeRO-Offload, Llama 2 7B)
    offload_plan.log            the planner's report of that run (`mode=plan plan.format=json`, last line JSON)

    python benchmarks/gpu_table.py /tmp/gpu_suite      # writes table.md and suite.json there, prints the table
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Optional

GB = 1e9
Row = tuple[str, str, str]


def last_json(path: Path) -> Optional[dict[str, Any]]:
    """The JSON object on the last non-empty line of a benchmark's output, or None."""
    if not path.is_file():
        return None
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    try:
        value = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def test_rows(junit: Path) -> list[Row]:
    """(test id, passed/failed/error/skipped, seconds or the skip/failure message) per test case."""
    if not junit.is_file():
        return [("pytest -m gpu", "not run", "no junit report")]
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, figure = "passed", f"{float(case.get('time', 0.0)):.1f} s"
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                figure = (found.get("message") or "").splitlines()[0][:160] if found.get("message") else ""
                break
        rows.append((name, outcome, figure.replace("|", "/")))
    return rows


def memory_rows(data: Optional[dict[str, Any]]) -> list[Row]:
    if data is None or "rows" not in data:
        return [("gpu_memory", "not run", "no JSON output")]
    rows = []
    for row in data["rows"]:
        error = row["error"]
        within = error is not None and abs(error) <= 0.05
        rows.append((f"planner memory, {row['layers']} layers, AC {row['activation_checkpointing']}"
                     + (", compiled" if row["compile"] else ""), "within 5%" if within else "off by more than 5%",
                     f"planner {row['planner_bytes'] / GB:.2f} GB, measured {row['measured']['peak_bytes'] / GB:.2f} GB "
                     f"({100 * error:+.1f}%)" if error is not None else "no measurement"))
    return rows


def throughput_rows(label: str, data: Optional[dict[str, Any]]) -> list[Row]:
    if data is None:
        return [(f"gpu_throughput {label}", "not run", "no JSON output")]
    if data.get("status") not in ("measured", "smoke"):  # e.g. "no CUDA device": nothing was run
        return [(f"gpu_throughput {label}", str(data.get("status")), "")]
    rows = []
    accumulation = data.get("accumulation", 1)
    shape = (f"{data['layers']} layers of Llama 3 8B width ({data['layers_from']}), seq {data['seq_len']} x "
             f"{data['micro_batch']}" + (f" x {accumulation} micro-batches per step" if accumulation > 1 else "")
             + f", {data['precision']}, AC {data['activation_checkpointing']}")
    for mode, figures in data.get("modes", {}).items():
        rows.append((f"gpu_throughput {label} {mode}", data["status"],
                     f"{figures['tokens_per_s']:,.0f} tokens/s, MFU {100 * figures['mfu']:.1f}%, peak "
                     f"{figures['peak_memory_bytes'] / GB:.1f} GB (planner {data['planner_memory_gb']:.1f} GB); {shape}"))
    return rows


def hf_rows(ours: Optional[dict[str, Any]], reference: Optional[dict[str, Any]]) -> list[Row]:
    if reference is None or reference.get("status") not in ("measured", "smoke"):
        return [("Hugging Face loop, 4 layers", "not run", "no JSON output")]
    figure = f"{reference['tokens_per_s']:,.0f} tokens/s, MFU {100 * reference['mfu']:.1f}%"
    mine = (ours or {}).get("modes", {}).get("compile")
    if mine:
        figure += f"; this trainer {mine['tokens_per_s']:,.0f} tokens/s: x{mine['tokens_per_s'] / reference['tokens_per_s']:.2f}"
    return [("Hugging Face LlamaForCausalLM loop, 4 layers, compiled, no AC", reference["status"], figure)]


def offload_rows(summary: Optional[dict[str, Any]], plan: Optional[dict[str, Any]]) -> list[Row]:
    if summary is None:
        return [("recipe=llama2_7b_1xh100_offload", "not run", "no summary.json")]
    held = (summary.get("state_bytes_per_rank") or [{}])[0] or {}
    peak = summary["peak_memory_bytes_per_rank"][0]
    planned = ""
    if plan is not None and plan.get("peak_phase"):
        planned_bytes = plan["details"]["phases"][plan["peak_phase"]]["total"]
        planned = (f" (planner {planned_bytes / GB:.1f} GB at {plan['peak_phase']}, {100 * (planned_bytes / peak - 1):+.1f}%;"
                   f" planner {plan['tokens_per_s']:,.0f} tokens/s)")
    return [("recipe=llama2_7b_1xh100_offload (Llama 2 7B, one GPU, ZeRO-Offload)", "measured",
             f"{summary['tokens_per_s']:,.0f} tokens/s, MFU {100 * summary['mfu']:.1f}% ({summary.get('throughput_window', '')}); "
             f"device peak {peak / GB:.1f} GB{planned}; optimizer {held.get('optimizer', 0) / GB:.1f} GB of which "
             f"{held.get('optimizer_host', 0) / GB:.1f} GB in host memory")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, help="the suite's results folder")
    args = parser.parse_args()
    out: Path = args.results
    parts = {"memory": read_json(out / "memory.json"),
             "throughput_bf16": last_json(out / "throughput_bf16.log"),
             "throughput_fp8": last_json(out / "throughput_fp8.log"),
             "throughput_bf16_acc8": last_json(out / "throughput_bf16_acc8.log"),
             "throughput_fp8_acc8": last_json(out / "throughput_fp8_acc8.log"),
             "throughput_4l": last_json(out / "throughput_4l.log"),
             "hf_4l": last_json(out / "hf_4l.log"),
             "offload": read_json(out / "offload_run" / "summary.json"),
             "offload_plan": last_json(out / "offload_plan.log")}
    rows = (test_rows(out / "junit.xml") + memory_rows(parts["memory"])
            + throughput_rows("bf16", parts["throughput_bf16"]) + throughput_rows("fp8", parts["throughput_fp8"])
            + throughput_rows("bf16 8 micro-batches", parts["throughput_bf16_acc8"])
            + throughput_rows("fp8 8 micro-batches", parts["throughput_fp8_acc8"])
            + throughput_rows("4 layers", parts["throughput_4l"]) + hf_rows(parts["throughput_4l"], parts["hf_4l"])
            + offload_rows(parts["offload"], parts["offload_plan"]))
    for suffix, label in (("", ""), ("_acc8", ", 8 micro-batches per step")):
        bf16, fp8 = parts["throughput_bf16" + suffix], parts["throughput_fp8" + suffix]
        try:
            fp8_speedup = fp8["modes"]["compile"]["tokens_per_s"] / bf16["modes"]["compile"]["tokens_per_s"]  # type: ignore[index]
            rows.append((f"fp8 / bf16, compiled{label}", "measured", f"x{fp8_speedup:.3f}"))
        except (KeyError, TypeError):
            pass
    table = "\n".join(["| test / benchmark | result | figure |", "|---|---|---|"]
                      + [f"| {name} | {outcome} | {figure} |" for name, outcome, figure in rows])
    (out / "table.md").write_text(table + "\n")
    (out / "suite.json").write_text(json.dumps({"rows": rows, **parts}, indent=1, default=str))
    print(table)


if __name__ == "__main__":
    main()
