"""The planner (`mode=plan`): memory per device, communication, step time and fit, before any run.

`plan(cfg) -> Plan` takes a composed config (model, strategy, precision, checkpointing, batch, and the
`hardware` group) and answers whether it fits, with what margin, how fast it should run, and, with
`plan.search=true` or when it does not fit, which configurations of the same world size fit best.
Modules: params (the parameter inventory the model's family declares), layout (what a config means), memory
(ZeRO-aware state bytes), activations (Korthikanti et al. 2022, with what bf16 autocast adds), phases (the
device peak: the largest phase of a step, counting the gradients present then), communication, timing
(Narayanan et al. 2021 FLOPs, bubble, MFU), exact (meta device + fake process group), search, report.
"""

from trainer.planner.core import Plan, Suggestion, plan
from trainer.planner.hardware import HardwareConfig

__all__ = ["HardwareConfig", "Plan", "Suggestion", "plan"]
