"""The plain Hugging Face reference for issue 27 item 5 ("speed >= 1.3x the plain Hugging Face loop").

Trains transformers' `LlamaForCausalLM` with a bare PyTorch loop on one GPU: the model is conf/model/llama3_8b.yaml
at full width (dim 4096, 32 heads, 8 KV heads, SwiGLU 14336, vocabulary 128,256, rope theta 500,000, untied
embeddings) with `--layers N` blocks, built from a config (no download: the HF config comes from the trainer's own
`trainer.models.llama.hf_adapter.LlamaHFAdapter.hf_config`), `attn_implementation="sdpa"`, fp32 parameters under
`torch.autocast("cuda", torch.bfloat16)` (what `precision=bf16` does), `torch.optim.AdamW(fused=True)` with
conf/optimizer/adamw.yaml's lr, betas, eps and weight decay on the trainer's decay/no-decay groups
(`trainer.optim.param_groups`), whole-model `torch.compile` unless `--no-compile`, HF's
`gradient_checkpointing_enable()` with `--gradient-checkpointing`. Batches are random tokens, labels = inputs
(HF shifts them). After `--warmup` steps, `--steps` steps are timed between two `torch.cuda.synchronize()`.

Reported: tokens/s, MFU against `--peak-flops` (default: this GPU's dense bf16 peak from conf/hardware/*.yaml,
matched by `benchmarks.gpu_throughput.hardware_for_device`, else `trainer.hardware.peak_flops`), with model
FLOPs per token from the trainer's own `CausalLM.flops_per_token` on the equivalent trainer config (Narayanan
et al. 2021: 6 x matmul weights + 12 x layers x seq x attention width; no recompute counted), and peak memory
(`torch.cuda.max_memory_allocated`). Compare with `benchmarks/gpu_throughput.py --layers N` (same seq/batch).

    python benchmarks/hf_reference.py --layers 8                # on a GPU, compiled
    python benchmarks/hf_reference.py --layers 8 --no-compile --gradient-checkpointing
    python benchmarks/hf_reference.py --smoke                   # CPU, tiny width, eager, 2 steps: the script works

Without CUDA (and without --smoke) it prints a JSON object with `"status": "no CUDA device"`.
The last line printed is one JSON object with every figure (`"benchmark": "hf_reference"`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu_throughput import REPO, SMOKE_MODEL, hardware_for_device  # noqa: E402

from trainer.config import compose  # noqa: E402
from trainer.hardware import peak_flops  # noqa: E402
from trainer.models import build_meta_model  # noqa: E402
from trainer.models.llama.hf_adapter import LlamaHFAdapter  # noqa: E402
from trainer.optim import param_groups  # noqa: E402


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8, help="transformer blocks of the 8B width")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="whole-model torch.compile")
    p.add_argument("--gradient-checkpointing", action="store_true", help="HF's gradient_checkpointing_enable()")
    p.add_argument("--peak-flops", type=float, default=None, help="MFU reference (default: conf/hardware bf16 peak)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny width, eager, 2 steps")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.seq_len, args.warmup, args.steps, args.compile = 2, 64, 1, 2, False
        args.peak_flops = args.peak_flops or 1e12  # nominal: a CPU has no data-sheet peak here
    return args


def trainer_config(args: argparse.Namespace) -> Any:
    """The trainer's composed config of the same model (model=llama3_8b, `--layers` blocks)."""
    overrides = ["model=llama3_8b", f"model.n_layers={args.layers}", f"trainer.seq_len={args.seq_len}"]
    overrides += SMOKE_MODEL if args.smoke else [f"model.max_seq_len={max(8192, args.seq_len)}"]
    return compose(overrides)


def mfu_peak(args: argparse.Namespace) -> tuple[float, Optional[str]]:
    """The MFU reference in FLOP/s and the conf/hardware option it came from (None: given or measured)."""
    if args.peak_flops is not None:
        return args.peak_flops, None
    name, total = torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory
    hardware = hardware_for_device(name, total)
    if hardware is not None:
        return float(OmegaConf.load(REPO / "conf" / "hardware" / f"{hardware}.yaml").peak_flops_bf16), hardware
    return peak_flops(torch.device("cuda"), torch.bfloat16), None


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    result: dict[str, Any] = {"benchmark": "hf_reference"}
    if not args.smoke and not torch.cuda.is_available():
        result["status"] = "no CUDA device"
        print(json.dumps(result))
        return result
    import transformers

    device = torch.device("cpu" if args.smoke else "cuda")
    cfg = trainer_config(args)
    ours = OmegaConf.to_object(cfg.model)
    meta = build_meta_model(ours)  # the trainer's model on meta: its FLOP count and parameter count
    flops_per_token, trainer_params = meta.flops_per_token(args.seq_len), meta.num_params()
    del meta
    hf_kwargs = {k: v for k, v in LlamaHFAdapter().hf_config(ours).items()
                 if k not in ("architectures", "model_type", "torch_dtype")}
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(**hf_kwargs, attn_implementation="sdpa", use_cache=False)
    model = transformers.LlamaForCausalLM(hf_cfg).to(device=device, dtype=torch.float32)
    model.train()
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    o = cfg.optimizer
    optimizer = torch.optim.AdamW(param_groups([model], float(o.weight_decay)), lr=float(o.lr),
                                  betas=tuple(o.betas), eps=float(o.eps), fused=True)
    step_model = torch.compile(model) if args.compile else model
    num_params = sum(p.numel() for p in model.parameters())

    def step() -> torch.Tensor:
        tokens = torch.randint(hf_cfg.vocab_size, (args.micro_batch, args.seq_len), device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = step_model(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    sync()
    seconds = time.perf_counter() - start

    peak, hardware = mfu_peak(args)
    tokens_per_s = args.steps * args.micro_batch * args.seq_len / seconds
    result.update(
        status="smoke" if args.smoke else "measured",
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        hardware=hardware, transformers=transformers.__version__, torch=torch.__version__, layers=args.layers,
        dim=hf_cfg.hidden_size, vocab_size=hf_cfg.vocab_size, num_params=num_params, trainer_num_params=trainer_params,
        seq_len=args.seq_len, micro_batch=args.micro_batch, warmup=args.warmup, steps=args.steps, compile=args.compile,
        gradient_checkpointing=args.gradient_checkpointing, precision="bf16 autocast, fp32 parameters",
        optimizer={"lr": float(o.lr), "betas": list(o.betas), "eps": float(o.eps),
                   "weight_decay": float(o.weight_decay), "fused": True},
        seconds=seconds, step_time_s=seconds / args.steps, tokens_per_s=tokens_per_s,
        flops_per_token=flops_per_token, flops_convention="trainer CausalLM.flops_per_token (Narayanan et al. 2021)",
        peak_flops=peak, mfu=tokens_per_s * flops_per_token / peak, final_loss=float(loss),
        peak_memory_bytes=torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
    )
    print(f"HF LlamaForCausalLM, {args.layers} layers ({num_params / 1e9:.2f}B), "
          f"seq {args.seq_len} x {args.micro_batch}, "
          f"compile={args.compile}, gc={args.gradient_checkpointing}: {tokens_per_s:,.0f} tokens/s, "
          f"MFU {100 * result['mfu']:.1f}%", flush=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
