"""Tokens/s per GPU and MFU of a Llama 3 8B-shaped model on one GPU, compiled and eager (issue 17).

The model is conf/model/llama3_8b.yaml at full width (dim 4096, 32 heads, 8 KV heads, SwiGLU 14336, vocabulary
128,256, rope theta 500,000) with as many layers as fit the GPU: the largest count whose planner estimate
(trainer/planner, `strategy=single`, this GPU's memory) fits, or `--layers N`. Settings follow torchtitan's
Llama 3 8B training config where one GPU allows: `precision=bf16`, `activation_checkpointing=selective`,
sequences of 8192 tokens, one sequence per micro-batch; `trainer.compile=true` for the compiled figure,
then the same run eager. The trainer runs in this process through `trainer.run.build_trainer`.

The figures reported per mode (`tokens_per_s`, `mfu`) are the trainer's own steady-state figures, the
`tokens_per_s` and `mfu` of the run's summary.json that `python -m trainer` prints at its end
(trainer/throughput.py: wall-clock between logged steps, read after the GPU has finished them), with
`trainer.throughput_warmup_steps=--warmup` and every step logged, so the steady window is the steps after
the warm-up that absorbs compilation and the allocator's growth: the CLI and this benchmark agree by
construction. As a cross-check, `benchmarks/_common.py`'s StepClock times the same steps independently
(it synchronizes the GPU at the end of every step); `step_clock_tokens_per_s` is its figure and
`trainer_over_step_clock` the ratio of the two (1.00 up to noise: anything else means one of the clocks
misses or double counts time). MFU is the trainer's: against the data-sheet dense peak of this GPU in the
dtype the matmuls run in (bf16 for bf16 and fp8 runs; `trainer.hardware`, the figures of
conf/hardware/*.yaml), else a measured matmul peak; `peak_flops` reports it. Also reported: the wall
average over the whole training (compilation included), peak allocated memory, and the planner's
predicted memory. Model FLOPs per token follow Narayanan et al. 2021 (6 x matmul parameters + attention),
the convention torchtitan's MFU uses.

torchtitan's published Llama 3.1 8B figures (8 H100s, FSDP over the full 32 layers, seq 8192, selective
AC, bf16): 5,762 tokens/s/GPU eager, 6,667 compiled, 8,532 compiled + float8. This run has fewer layers on
one GPU and no data-parallel communication, so the per-GPU comparison is indicative only; the output says
so. When torchtitan is importable its version is reported beside them; its stock `8B` flavour has all 32
layers, which do not fit one 80 GB GPU with Adam states, so no side-by-side torchtitan run happens here.

    python benchmarks/gpu_throughput.py                       # on a GPU: layers from the planner, ~5 min
    python benchmarks/gpu_throughput.py --layers 8 --modes compile --steps 20
    python benchmarks/gpu_throughput.py --smoke               # CPU, tiny width, a few seconds: the script works

Without CUDA (and without --smoke) it prints why and a JSON object with `"status": "no CUDA device"`.
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import StepClock  # noqa: E402

from trainer.callback import Callback  # noqa: E402
from trainer.config import compose, validate  # noqa: E402
from trainer.planner import plan  # noqa: E402
from trainer.run import build_trainer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# torchtitan's Llama 3.1 8B on 8 H100s (tokens/s per GPU; docs/BENCHMARKS.md cites them).
TORCHTITAN_8XH100 = {"eager": 5762.0, "compile": 6667.0, "compile_float8": 8532.0}
# Smoke mode: the same composition (model=llama3_8b, then overrides) shrunk to run on a CPU in seconds.
SMOKE_MODEL = ["model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=128",
               "model.vocab_size=256", "model.max_seq_len=64"]


def hardware_for_device(name: str, total_bytes: float) -> Optional[str]:
    """The conf/hardware/ option describing the GPU called `name` (torch.cuda.get_device_name), or None.

    A file matches when its model token (h100_80g -> H100, rtx3090 -> 3090) is in the device name; of
    several (a100_40g, a100_80g) the one whose memory is closest to the device's wins.
    """
    matches = []
    for path in sorted((REPO / "conf" / "hardware").glob("*.yaml")):
        node = OmegaConf.load(path)
        if node.get("device_type") != "cuda":
            continue
        token = path.stem.split("_")[0].upper().removeprefix("RTX")
        if token in name.upper():
            matches.append((abs(float(node.memory_gb) * 1e9 - total_bytes), path.stem))
    return min(matches)[1] if matches else None


def base_overrides(args: argparse.Namespace, layers: int, hardware: Optional[str], memory_gb: Optional[float]) -> list[str]:
    """The run's config, without the compile choice."""
    steps = args.warmup + args.steps
    overrides = ["model=llama3_8b", f"model.n_layers={layers}", "strategy=single", "trainer.devices=1",
                 f"precision={args.precision}", f"activation_checkpointing={args.ac}",
                 f"trainer.seq_len={args.seq_len}", f"trainer.micro_batch_size={args.micro_batch}",
                 f"trainer.global_batch_size={args.micro_batch * args.accumulation}", f"trainer.max_steps={steps}",
                 # every step logged: the trainer's steady window starts right after the warm-up
                 "trainer.log_every=1", f"trainer.throughput_warmup_steps={args.warmup}",
                 "trainer.val_every=0", "trainer.val_batches=1",
                 "lr_schedule.warmup_steps=1", "callbacks=none", "trainer.save_final=false"]
    if args.smoke:
        overrides += SMOKE_MODEL + ["trainer.accelerator=cpu", "trainer.peak_flops=1e12", "data.max_bytes=200000"]
    else:
        overrides += ["trainer.accelerator=cuda"]
    if hardware is not None:
        overrides.append(f"hardware={hardware}")
    if memory_gb is not None:  # the planner checks the fit against this GPU, not the data sheet's model
        overrides.append(f"hardware.memory_gb={memory_gb}")
    return overrides


def planned(overrides: list[str]) -> Any:
    """The planner's analytic estimate of a config (milliseconds: no exact mode, no search)."""
    cfg = compose(overrides + ["mode=plan"])
    validate(cfg)
    return plan(cfg, exact=False, search=False)


def planned_compile(modes: list[str]) -> list[str]:
    """The compile choice the planner is asked about: compiled only when every mode is (a compiled run holds
    less than eager, no fp32 loss tensors nor autocast's cache of weight casts, so a layer count that fits
    eager fits both)."""
    return [f"trainer.compile={'true' if modes and all(m == 'compile' for m in modes) else 'false'}"]


def layers_that_fit(args: argparse.Namespace, hardware: Optional[str], memory_gb: Optional[float],
                    modes: list[str]) -> tuple[int, Any]:
    """The most layers (at most Llama 3 8B's 32) whose planner estimate fits this GPU, and that plan."""
    for layers in range(32, 0, -1):
        result = planned(base_overrides(args, layers, hardware, memory_gb) + planned_compile(modes))
        if result.fits:
            return layers, result
    raise SystemExit("not even one layer of the 8B width fits this GPU according to the planner")


class KernelTable(Callback):
    """torch.profiler over `steps` steps after `warmup`: the kernel table (by device time) goes to `path`."""

    def __init__(self, path: Path, warmup: int, steps: int = 2) -> None:
        self.path, self.warmup, self.steps = path, warmup, steps
        self.profiler: Optional[torch.profiler.profile] = None

    def on_train_batch_start(self, trainer: Any, batch: Any) -> None:
        if trainer.step == self.warmup:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        if self.profiler is not None and trainer.step == self.warmup + self.steps:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)
            sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
            self.path.write_text(f"{self.steps} steps after {self.warmup} warm-up steps, sorted by {sort}\n"
                                 + self.profiler.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=90))
            self.profiler = None


# Steps a profiled run adds to the warm-up: the two profiled steps and the one whose interval holds the
# writing of the kernel table (the trainer's clock closes a step's interval before its callbacks run).
PROFILE_STEPS = 3


def run_mode(overrides: list[str], warmup: int, tokens_per_step: int,
             profile: Optional[Path] = None) -> dict[str, Any]:
    """One training run: the trainer's steady-state tokens/s and MFU (its summary) over the steps after the
    warm-up, StepClock's figure over the same steps and their ratio, peak memory, loss. With `profile`, the
    two steps after the warm-up are profiled and PROFILE_STEPS steps join the warm-up (the caller adds
    them to max_steps)."""
    clock = StepClock()
    with tempfile.TemporaryDirectory() as run_dir:
        if profile is not None:
            overrides = overrides + [f"trainer.throughput_warmup_steps={warmup + PROFILE_STEPS}"]
        trainer = build_trainer(compose(overrides), Path(run_dir))
        if profile is not None:
            trainer.callbacks.append(KernelTable(profile, warmup))
            warmup += PROFILE_STEPS
        trainer.callbacks.append(clock)
        summary = trainer.fit()
        flops_per_token = trainer.flops_per_token
        loss = trainer.last_train_loss
        device = trainer.strategy.device
        # Free this run's model, optimizer and compiled graphs before the next run allocates its own.
        del trainer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    measured = clock.times[warmup:]
    step_times = [b - a for a, b in zip(measured, measured[1:])]
    step_clock = len(step_times) * tokens_per_step / (measured[-1] - measured[0])
    return {"tokens_per_s": summary["tokens_per_s"], "mfu": summary["mfu"],
            "throughput_window": summary["throughput_window"],
            "throughput_window_steps": summary["throughput_window_steps"],
            "tokens_per_s_wall_average": summary["tokens_per_s_wall_average"],
            "mfu_wall_average": summary["mfu_wall_average"],
            "step_clock_tokens_per_s": step_clock, "trainer_over_step_clock": summary["tokens_per_s"] / step_clock,
            "step_s_median": statistics.median(step_times), "step_s": step_times,
            "flops_per_token": flops_per_token, "peak_flops": summary["peak_flops_per_device"],
            "peak_memory_bytes": summary["peak_memory_bytes_per_rank"][0], "last_train_loss": loss}


def torchtitan_status() -> dict[str, Any]:
    """Whether torchtitan is importable here, and what this script does with it."""
    try:
        module = importlib.import_module("torchtitan")
    except ImportError:
        return {"installed": False, "note": "torchtitan not installed"}
    return {"installed": True, "version": getattr(module, "__version__", "unknown"),
            "note": "torchtitan's 8B flavour has 32 layers, which do not fit one GPU with Adam states; compare "
                    "with its published 8-GPU figures (torchtitan_8xh100_tokens_per_s_per_gpu)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=None, help="transformer layers (default: most that fit)")
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence (torchtitan's 8B: 8192)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--accumulation", type=int, default=1,
                        help="micro-batches per optimizer step (8: the optimizer work per token of torchtitan's "
                             "8-GPU FSDP run, where each GPU steps an eighth of the parameters)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the clock starts (compilation)")
    parser.add_argument("--modes", default="compile,eager", help="compile and/or eager, comma-separated")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--ac", default="selective", help="activation_checkpointing option")
    parser.add_argument("--profile", type=Path, default=None,
                        help="write torch.profiler's kernel table of 2 steps of the first mode here (3 extra steps)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, a 64-wide model, 2 layers, 64-token sequences, eager: checks the script runs")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if any(m not in ("compile", "eager") for m in modes):
        parser.error(f"--modes takes compile and/or eager, got {args.modes}")

    result: dict[str, Any] = {"benchmark": "gpu_throughput", "torchtitan": torchtitan_status(),
                              "torchtitan_8xh100_tokens_per_s_per_gpu": TORCHTITAN_8XH100}
    if args.smoke:
        # Inductor's C++ compilation of even a tiny model takes minutes on a small CPU: eager only.
        args.seq_len, args.steps, args.warmup, args.layers = min(args.seq_len, 64), min(args.steps, 2), 1, args.layers or 2
        modes = ["eager"]
        result.update(status="smoke", device="cpu")
        hardware, memory_gb, total = None, None, None
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing measured (--smoke runs the script on the CPU)")
        print(json.dumps({**result, "status": "no CUDA device"}))
        return
    else:
        name = torch.cuda.get_device_name()
        total = float(torch.cuda.get_device_properties(0).total_memory)
        hardware = hardware_for_device(name, total)
        memory_gb = total / 1e9
        result.update(status="measured", device=name, hardware=hardware, device_memory_gb=memory_gb)

    if args.layers is None:
        layers, estimate = layers_that_fit(args, hardware, memory_gb, modes)
        result["layers_from"] = "planner"
    else:
        layers = args.layers
        estimate = planned(base_overrides(args, layers, hardware, memory_gb) + planned_compile(modes))
        result["layers_from"] = "--layers"
    overrides = base_overrides(args, layers, hardware, memory_gb)
    tokens_per_step = args.seq_len * args.micro_batch * args.accumulation
    cfg = compose(overrides)
    result.update(layers=layers, num_params=estimate.num_params, seq_len=args.seq_len,
                  micro_batch=args.micro_batch, accumulation=args.accumulation, precision=args.precision, activation_checkpointing=args.ac,
                  steps=args.steps, warmup=args.warmup, overrides=overrides,
                  planner_memory_gb=estimate.memory["total"] / 1e9, planner_fits=estimate.fits,
                  planner_mfu=estimate.mfu)
    print(f"{cfg.model.name} width, {layers} layers ({estimate.num_params / 1e9:.2f}B parameters), "
          f"seq {args.seq_len} x {args.micro_batch}, precision={args.precision}, "
          f"activation_checkpointing={args.ac}; planner: {estimate.memory['total'] / 1e9:.1f} GB", flush=True)

    result["modes"] = {}
    for index, mode in enumerate(modes):
        profile = args.profile if index == 0 else None
        extra = [f"trainer.max_steps={args.warmup + args.steps + PROFILE_STEPS}"] if profile is not None else []
        figures = run_mode(overrides + [f"trainer.compile={'true' if mode == 'compile' else 'false'}"] + extra,
                           args.warmup, tokens_per_step, profile)
        # The MFU reference is the trainer's (the same in every mode): this GPU's data-sheet peak in the
        # dtype the matmuls run in; in smoke mode the configured trainer.peak_flops.
        result["peak_flops"] = figures["peak_flops"]
        reference = None if args.smoke else TORCHTITAN_8XH100.get(mode)  # a tiny CPU model compares to nothing
        figures["ratio_to_torchtitan_8xh100"] = figures["tokens_per_s"] / reference if reference else None
        result["modes"][mode] = figures
        print(f"{mode}: {figures['tokens_per_s']:,.0f} tokens/s/GPU, MFU {100 * figures['mfu']:.1f}% (the trainer's "
              f"steady state; StepClock {figures['step_clock_tokens_per_s']:,.0f}, ratio "
              f"{figures['trainer_over_step_clock']:.3f}; wall average {figures['tokens_per_s_wall_average']:,.0f}), "
              f"peak {figures['peak_memory_bytes'] / 2**30:.1f} GiB (planner {result['planner_memory_gb']:.1f} GB)"
              + (f"; torchtitan {reference:,.0f} (8 GPUs, 32 layers: indicative)" if reference else ""), flush=True)
    result["comparison_note"] = ("torchtitan's figures are Llama 3.1 8B on 8 H100s with FSDP over all 32 layers; "
                                 f"this run is {layers} layers of the same width on one GPU without data-parallel "
                                 "communication, so the per-GPU comparison is indicative only")
    print(result["comparison_note"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
