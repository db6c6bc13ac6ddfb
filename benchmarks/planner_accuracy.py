"""How close the planner's activation estimate is to what a forward really saves, and how long planning takes.

For the tiny Llama (and a wider variant) on this CPU, at a few micro-batch and sequence sizes, under every
checkpointing policy: the bytes saved for the backward (measured with
plugins/activation_checkpointing/accounting.py's SavedActivationMeter) against `estimate_activations`,
as a ratio. Then the wall time of `plan()` for each recipe, analytic only and with exact mode (meta device,
fake process group). The last line is one JSON object with every figure.

    python benchmarks/planner_accuracy.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from hydra.utils import instantiate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.plugins.activation_checkpointing.accounting import SavedActivationMeter  # noqa: E402
from trainer.config import RECIPES_DIR, compose, validate  # noqa: E402
from trainer.loss import cross_entropy_loss  # noqa: E402
from trainer.models import build_model  # noqa: E402
from trainer.planner import plan  # noqa: E402
from trainer.planner.activations import estimate_activations  # noqa: E402
from trainer.planner.layout import layout_from_config, model_config  # noqa: E402
from trainer.planner.params import inventory  # noqa: E402

POLICIES = ("none", "attention", "selective", "every_n", "full")
SHAPES = {  # name: (model overrides, micro-batch, seq_len)
    "tiny b4 s128": ([], 4, 128),
    "tiny b2 s512": ([], 2, 512),
    "wide b2 s256": (["model.dim=512", "model.n_heads=8", "model.n_kv_heads=2", "model.ffn_hidden_dim=1408"], 2, 256),
}


def measure(overrides: list[str], micro: int, seq: int, policy: str) -> tuple[int, float]:
    cfg = compose(["model=tiny", f"trainer.micro_batch_size={micro}", f"trainer.seq_len={seq}",
                   f"trainer.global_batch_size={micro}", f"activation_checkpointing={policy}", *overrides])
    torch.manual_seed(0)
    model = build_model(model_config(cfg))
    checkpointing = instantiate(cfg.activation_checkpointing)
    meter = SavedActivationMeter.applying(checkpointing, model)
    tokens = torch.randint(0, 256, (micro, seq))
    with meter:
        loss = cross_entropy_loss(model(tokens), torch.roll(tokens, -1, 1))
    loss.backward()
    estimate = estimate_activations(inventory(model_config(cfg)), layout_from_config(cfg), 0, "cpu").device
    return meter.bytes, estimate


def main() -> None:
    results: dict[str, object] = {"activations": [], "plan_time_s": {}}
    print(f"{'shape':<14} {'policy':<10} {'measured MB':>12} {'estimated MB':>13} {'ratio':>7}")
    for shape, (overrides, micro, seq) in SHAPES.items():
        for policy in POLICIES:
            measured, estimate = measure(overrides, micro, seq, policy)
            ratio = estimate / measured
            print(f"{shape:<14} {policy:<10} {measured / 1e6:12.2f} {estimate / 1e6:13.2f} {ratio:7.4f}")
            row = {"shape": shape, "policy": policy, "measured_bytes": measured, "estimated_bytes": estimate,
                   "ratio": ratio}
            results["activations"].append(row)  # type: ignore[union-attr]
    print(f"\n{'recipe':<28} {'analytic s':>10} {'with exact s':>13} {'fits':>5}")
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        extra = ["init_from=null"] if "finetune" in path.stem else []
        cfg = compose([f"recipe={path.stem}", "mode=plan", *extra])
        validate(cfg)
        start = time.perf_counter()
        analytic = plan(cfg, exact=False, search=False)
        middle = time.perf_counter()
        plan(cfg, exact=True, search=False)
        end = time.perf_counter()
        print(f"{path.stem:<28} {middle - start:10.2f} {end - middle:13.2f} {str(analytic.fits):>5}")
        results["plan_time_s"][path.stem] = {"analytic": middle - start, "exact": end - middle}  # type: ignore[index]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
