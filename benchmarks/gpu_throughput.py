"""Tokens/s per GPU and MFU of a Llama 3 8B-shaped model on one GPU, compiled and eager (issue 17).

The model is conf/model/llama3_8b.yaml at full width (dim 4096, 32 heads, 8 KV heads, SwiGLU 14336, vocabulary
128,256, rope theta 500,000) with as many layers as fit the GPU: the largest count whose planner estimate
(trainer/planner, `strategy=single`, this GPU's memory) fits, or `--layers N`. Settings follow torchtitan's
Llama 3 8B training config where one GPU allows: `precision=bf16`, `activation_checkpointing=selective`,
sequences of 8192 tokens, one sequence per micro-batch; `trainer.compile=true` for the compiled figure,
then the same run eager. The trainer runs in this process through `trainer.run.build_trainer`; each
step is timed by `benchmarks/_common.py`'s StepClock (which synchronizes the GPU), after `--warmup` steps
that absorb compilation and the allocator's growth.

Reported per mode: tokens/s on this GPU, MFU against the data-sheet dense bf16 peak of this GPU (read from
conf/hardware/*.yaml by the name torch.cuda.get_device_name gives, else `trainer.hardware`'s table or a
measured matmul peak), peak allocated memory, and the planner's predicted memory. Model FLOPs per token
follow Narayanan et al. 2021 (6 x matmul parameters + attention), the convention torchtitan's MFU uses.

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

from trainer.config import compose, validate  # noqa: E402
from trainer.hardware import peak_flops  # noqa: E402
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
                 f"trainer.global_batch_size={args.micro_batch}", f"trainer.max_steps={steps}",
                 f"trainer.log_every={steps}", "trainer.val_every=0", "trainer.val_batches=1",
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


def layers_that_fit(args: argparse.Namespace, hardware: Optional[str], memory_gb: Optional[float]) -> tuple[int, Any]:
    """The most layers (at most Llama 3 8B's 32) whose planner estimate fits this GPU, and that plan."""
    for layers in range(32, 0, -1):
        result = planned(base_overrides(args, layers, hardware, memory_gb))
        if result.fits:
            return layers, result
    raise SystemExit("not even one layer of the 8B width fits this GPU according to the planner")


def run_mode(overrides: list[str], warmup: int, tokens_per_step: int) -> dict[str, Any]:
    """One training run; tokens/s over the steps after the warm-up, peak memory, loss."""
    clock = StepClock()
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = build_trainer(compose(overrides), Path(run_dir))
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
    tokens_per_s = len(step_times) * tokens_per_step / (measured[-1] - measured[0])
    return {"tokens_per_s": tokens_per_s, "step_s_median": statistics.median(step_times),
            "step_s": step_times, "flops_per_token": flops_per_token,
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
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the clock starts (compilation)")
    parser.add_argument("--modes", default="compile,eager", help="compile and/or eager, comma-separated")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--ac", default="selective", help="activation_checkpointing option")
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
        layers, estimate = layers_that_fit(args, hardware, memory_gb)
        result["layers_from"] = "planner"
    else:
        layers = args.layers
        estimate = planned(base_overrides(args, layers, hardware, memory_gb))
        result["layers_from"] = "--layers"
    overrides = base_overrides(args, layers, hardware, memory_gb)
    tokens_per_step = args.seq_len * args.micro_batch
    cfg = compose(overrides)
    result.update(layers=layers, num_params=estimate.num_params, seq_len=args.seq_len,
                  micro_batch=args.micro_batch, precision=args.precision, activation_checkpointing=args.ac,
                  steps=args.steps, warmup=args.warmup, overrides=overrides,
                  planner_memory_gb=estimate.memory["total"] / 1e9, planner_fits=estimate.fits,
                  planner_mfu=estimate.mfu)
    print(f"{cfg.model.name} width, {layers} layers ({estimate.num_params / 1e9:.2f}B parameters), "
          f"seq {args.seq_len} x {args.micro_batch}, precision={args.precision}, "
          f"activation_checkpointing={args.ac}; planner: {estimate.memory['total'] / 1e9:.1f} GB", flush=True)

    # The MFU reference: this GPU's data-sheet peak in the dtype the matmuls run in (bf16 for bf16/fp8's
    # high-precision parts), from conf/hardware/ when the GPU is described there.
    if args.smoke:
        peak = float(cfg.trainer.peak_flops)
    elif hardware is not None:
        peak = float(OmegaConf.load(REPO / "conf" / "hardware" / f"{hardware}.yaml").peak_flops_bf16)
    else:
        peak = peak_flops(torch.device("cuda"), torch.bfloat16)
    result["peak_flops"] = peak

    result["modes"] = {}
    for mode in modes:
        figures = run_mode(overrides + [f"trainer.compile={'true' if mode == 'compile' else 'false'}"],
                           args.warmup, tokens_per_step)
        figures["mfu"] = figures["tokens_per_s"] * figures["flops_per_token"] / peak
        reference = None if args.smoke else TORCHTITAN_8XH100.get(mode)  # a tiny CPU model compares to nothing
        figures["ratio_to_torchtitan_8xh100"] = figures["tokens_per_s"] / reference if reference else None
        result["modes"][mode] = figures
        print(f"{mode}: {figures['tokens_per_s']:,.0f} tokens/s/GPU, MFU {100 * figures['mfu']:.1f}%, "
              f"peak {figures['peak_memory_bytes'] / 2**30:.1f} GiB (planner {result['planner_memory_gb']:.1f} GB)"
              + (f"; torchtitan {reference:,.0f} (8 GPUs, 32 layers: indicative)" if reference else ""), flush=True)
    result["comparison_note"] = ("torchtitan's figures are Llama 3.1 8B on 8 H100s with FSDP over all 32 layers; "
                                 f"this run is {layers} layers of the same width on one GPU without data-parallel "
                                 "communication, so the per-GPU comparison is indicative only")
    print(result["comparison_note"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
