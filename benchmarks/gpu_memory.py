"""The planner's device memory against what the allocator holds, across layer counts, AC policies and
compilation (issue 27, item 4).

Each row trains the Llama 3 8B width (conf/model/llama3_8b.yaml: dim 4096, 32 heads, 8 KV heads, SwiGLU
14336, vocabulary 128,256) with `--layers` layers for `--steps` steps on one GPU, `strategy=single`, and
compares `trainer.planner.plan`'s device total (its analytic mode, what `mode=plan` prints) with
`torch.cuda.max_memory_allocated` over the run. A callback also reads the allocator at the phases of every
step, so a difference can be traced to a term: the model states at a step's start, what the forward
added by its end (activations, logits, loss), the backward's peak above that, the optimizer step's.

    python benchmarks/gpu_memory.py                                  # 2 and 4 layers x none/selective/full
    python benchmarks/gpu_memory.py --layers 2,6 --ac none --compile true,false
    python benchmarks/gpu_memory.py --smoke                          # CPU, tiny width: the script runs

The last line printed is one JSON object with every row; `--json PATH` also writes it to a file.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu_throughput import base_overrides, hardware_for_device, planned  # noqa: E402
from trainer.callback import Callback  # noqa: E402
from trainer.config import compose  # noqa: E402
from trainer.run import build_trainer  # noqa: E402

GB = 1e9


class PhaseMemory(Callback):
    """The allocator's current and peak bytes at the phases of each step (CUDA only; zeros elsewhere)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []
        self._row: dict[str, int] = {}

    @staticmethod
    def _read(device: torch.device) -> tuple[int, int]:
        if device.type != "cuda":
            return 0, 0
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)

    def on_train_batch_start(self, trainer: Any, batch: Any) -> None:
        device = trainer.strategy.device
        self._row = {"start": self._read(device)[0]}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def on_before_backward(self, trainer: Any, loss: torch.Tensor) -> None:
        if "forward_end" not in self._row:  # the first micro-batch's
            self._row["forward_end"], self._row["forward_peak"] = self._read(trainer.strategy.device)

    def on_after_backward(self, trainer: Any) -> None:
        self._row["backward_end"], self._row["backward_peak"] = self._read(trainer.strategy.device)

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        self._row["end"], self._row["step_peak"] = self._read(trainer.strategy.device)
        self.steps.append(self._row)


def measure(overrides: list[str]) -> dict[str, Any]:
    phases = PhaseMemory()
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = build_trainer(compose(overrides), Path(run_dir))
        device = trainer.strategy.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        trainer.callbacks.append(phases)
        summary = trainer.fit()
        del trainer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"peak_bytes": summary["peak_memory_bytes_per_rank"][0], "state_bytes": summary["state_bytes_per_rank"][0],
            "phases": phases.steps, "tokens_per_s": summary["tokens_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default="2,4")
    parser.add_argument("--ac", default="none,selective,full", help="activation_checkpointing options")
    parser.add_argument("--compile", default="false", help="true and/or false, comma-separated")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--extra", default="", help="more overrides for every row, space-separated")
    parser.add_argument("--smoke", action="store_true", help="CPU, a 64-wide model: checks the script runs")
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON object here")
    args = parser.parse_args()
    args.warmup = 0
    hardware = memory_gb = None
    device_name = "cpu"
    if args.smoke:
        args.seq_len = min(args.seq_len, 64)
    elif not torch.cuda.is_available():
        print(json.dumps({"benchmark": "gpu_memory", "status": "no CUDA device"}))
        return
    else:
        device_name = torch.cuda.get_device_name()
        total = float(torch.cuda.get_device_properties(0).total_memory)
        hardware, memory_gb = hardware_for_device(device_name, total), total / GB

    rows = []
    for layers, ac, compiled in itertools.product([int(n) for n in args.layers.split(",")], args.ac.split(","),
                                                  args.compile.split(",")):
        row_args = argparse.Namespace(**{**vars(args), "ac": ac})
        overrides = base_overrides(row_args, layers, hardware, memory_gb) + [f"trainer.compile={compiled}"] + args.extra.split()
        estimate = planned(overrides)
        measured = measure(overrides)
        predicted = estimate.memory["total"]
        row = {"layers": layers, "activation_checkpointing": ac, "compile": compiled == "true",
               "planner_bytes": predicted, "planner_terms": dict(estimate.memory),
               "planner_peak_phase": estimate.peak_phase, "measured": measured,
               "error": predicted / measured["peak_bytes"] - 1 if measured["peak_bytes"] else None}
        rows.append(row)
        print(f"layers {layers}, ac {ac}, compile {compiled}: planner {predicted / GB:.2f} GB, "
              f"measured {measured['peak_bytes'] / GB:.2f} GB"
              + (f" ({100 * row['error']:+.1f}%)" if row["error"] is not None else "")
              + f"; phases of the last step {measured['phases'][-1] if measured['phases'] else {}}", flush=True)
    result = {"benchmark": "gpu_memory", "device": device_name, "seq_len": args.seq_len,
              "micro_batch": args.micro_batch, "precision": args.precision, "rows": rows}
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
