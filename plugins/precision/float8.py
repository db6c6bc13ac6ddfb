"""float8 training: the transformer's linear layers multiply in float8 through torchao's `Float8Linear`.

`precision=fp8` is bf16 mixed precision (fp32 master weights and optimizer states, bf16 autocast) in
which every eligible `nn.Linear` becomes a `torchao.float8.Float8Linear` before the model is parallelized
(on the meta device, as torchtitan's model converters do): its input, weight and output gradient are cast
to float8 with dynamically computed scales for the three matmuls of a linear layer (forward, input
gradient, weight gradient), and the results come back in the autocast dtype.

- Recipes (`precision.recipe`): `tensorwise` (one scale per tensor; e4m3 for everything, torchao's
  default and the fastest), `rowwise` (one scale per row, more accurate with outliers) and
  `rowwise_with_gw_hp` (rowwise, with the weight gradient's matmul in high precision).
- Left in high precision: the output layer (`precision.skip`, as torchtitan does: the logits are the most
  sensitive matmul) and any linear layer whose dimensions are not multiples of 16 (float8 matmul kernels
  need them; e.g. a MoE router of 8 experts). MoE experts use grouped matmuls, not `nn.Linear`, and stay
  in bf16.
- Under FSDP2 (zero2, zero3, fsdp, the sharded 3d flavours) with the tensorwise recipe, the weights are
  all-gathered in float8 (`precision.fsdp_float8_all_gather`, half of bf16's traffic), and after each
  optimizer step one all-reduce computes every layer's scale for the next all-gather
  (`precompute_float8_dynamic_scale_for_fsdp`) instead of one per weight.
- float8 matmuls need float8 tensor cores (CUDA compute capability >= 8.9: H100, H200, L4, B200...).
  Elsewhere the run is refused unless `precision.emulate=true`, with which torchao computes the same
  casts and scales and multiplies in high precision: the numerics of float8 training on any device, at
  no speed gain (what the CPU tests use).
- Not under tensor parallelism: torchao's float8 TP styles (`Float8ColwiseParallel`, ...) exchange
  float8 tensors between the tp ranks, which gloo cannot carry ("Invalid scalar type"), so they could not
  be tested here, and are not wired into our plan; tp > 1 is refused at validation.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any, Sequence

import torch
import torch.nn as nn

from trainer.plugins.precision.mixed import BF16Mixed

log = logging.getLogger("trainer")

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# float8 GEMM kernels need both matmul dimensions to be multiples of this.
FLOAT8_DIM_MULTIPLE = 16


class _ImportNoise(logging.Filter):
    """What importing torchao logs that says nothing about this run: a warning per prebuilt CUDA kernel
    library it cannot load (those of other GPU architectures; all of them on a CPU machine), and torch's
    deprecation notice for an Enum it registers with pytree."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Failed to load") or "is an Enum subclass and is now natively" in message)


def _torchao_float8() -> Any:
    """torchao.float8, imported without its import-time noise (`_ImportNoise`)."""
    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ImportNoise) for f in logger.filters):
            logger.addFilter(_ImportNoise())
    import torchao.float8

    return torchao.float8


def float8_hardware_problem(device_type: str) -> str | None:
    """Why this machine cannot run float8 matmuls natively (None when it can)."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return f"this machine's device ({device_type}) has no float8 matmuls"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return (f"this GPU ({torch.cuda.get_device_name()}, compute capability {major}.{minor}) has no float8 "
                "tensor cores (they need compute capability >= 8.9: H100, H200, L4, B200...)")
    return None


class Float8(BF16Mixed):
    """bf16 mixed precision whose linear layers multiply in float8 (torchao); see the module docstring."""

    name = "fp8"

    def __init__(self, recipe: str = "tensorwise", emulate: bool = False, fsdp_float8_all_gather: bool = True,
                 skip: Sequence[str] = ("output",), reduce_dtype: str = "fp32") -> None:
        super().__init__(reduce_dtype=reduce_dtype)
        if recipe not in RECIPES:
            raise ValueError(f"precision.recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
        self.recipe = recipe
        self.emulate = bool(emulate)
        # float8 all-gather exists for tensorwise scales only (a rowwise scale differs along the shard).
        self.fsdp_float8_all_gather = bool(fsdp_float8_all_gather) and recipe == "tensorwise"
        self.skip = tuple(skip)
        # The converted models, for the per-step scale precomputation under FSDP2 (held weakly: a model
        # must be released before its process group is destroyed, see trainer.run.train).
        self._models: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    # ---- checks -------------------------------------------------------------------------------------
    def check_strategy(self, strategy: Any, device_type: str) -> None:
        super().check_strategy(strategy, device_type)
        try:
            _torchao_float8()
        except ImportError:
            raise ValueError("precision=fp8 needs torchao (pip install torchao, or the project's [fp8] "
                             "extra)") from None
        problem = float8_hardware_problem(device_type)
        if problem is not None and not self.emulate:
            raise ValueError(f"precision=fp8: {problem}; precision.emulate=true runs float8 numerics emulated "
                             "(no speed-up), or use precision=bf16")

    def tensor_parallel_problem(self) -> str | None:
        return ("precision=fp8 does not run under tensor parallelism yet (use tp=1 with a data-parallel or "
                "pipeline strategy, or precision=bf16)")

    def float8_config(self, gathered_parameters: bool) -> Any:
        config = _torchao_float8().Float8LinearConfig.from_recipe_name(self.recipe)
        return dataclasses.replace(config, emulate=self.emulate,
                                   enable_fsdp_float8_all_gather=self.fsdp_float8_all_gather and gathered_parameters)

    # ---- the model ----------------------------------------------------------------------------------
    def eligible(self, module: nn.Module, name: str) -> bool:
        """Whether the linear layer `name` multiplies in float8."""
        if not isinstance(module, nn.Linear) or name.split(".")[-1] in self.skip or name in self.skip:
            return False
        return module.in_features % FLOAT8_DIM_MULTIPLE == 0 and module.out_features % FLOAT8_DIM_MULTIPLE == 0

    def convert_model(self, model: nn.Module, gathered_parameters: bool = False) -> None:
        config = self.float8_config(gathered_parameters)
        _torchao_float8().convert_to_float8_training(model, config=config, module_filter_fn=self.eligible)
        count = sum(1 for module in model.modules() if type(module).__name__ == "Float8Linear")
        log.info("precision=fp8: %d linear layers in float8 (%s scales%s%s)", count, self.recipe,
                 ", with float8 all-gather" if config.enable_fsdp_float8_all_gather else "",
                 ", emulated" if self.emulate else "")
        if config.enable_fsdp_float8_all_gather:
            self._models.add(model)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        stepped = super().optimizer_step(optimizer)
        if stepped and len(self._models):
            precompute = _torchao_float8().precompute_float8_dynamic_scale_for_fsdp
            for model in self._models:
                precompute(model)
        return stepped
