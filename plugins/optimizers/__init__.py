"""Optimizer plugins: one file per optimizer, each with its Hydra schema (a dataclass).

``optimizer=NAME`` picks ``conf/optimizer/NAME.yaml``, whose defaults list names ``NAME_schema``: the entry
of ``SCHEMAS`` below, stored by ``trainer.config.register_configs``. The schema's ``_target_`` is the
optimizer class (torch's own for adamw and sgd, :class:`Muon` here for muon); the trainer builds it over
the parameter groups of ``trainer.optim.param_groups`` (the one place that decides what gets weight decay
and, for an optimizer that asks with ``hidden_matrix_group = True``, which parameters are the hidden
matrices). A new optimizer needs its file here (class and schema, listed in ``SCHEMAS``) and a YAML file.
"""

from trainer.plugins.optimizers.adamw import AdamWConfig
from trainer.plugins.optimizers.muon import Muon, MuonConfig, newton_schulz
from trainer.plugins.optimizers.sgd import SGDConfig

# Option name (`optimizer=NAME`) -> schema, registered in Hydra's ConfigStore as `<name>_schema`.
SCHEMAS: dict[str, type] = {"adamw": AdamWConfig, "sgd": SGDConfig, "muon": MuonConfig}

__all__ = ["AdamWConfig", "SGDConfig", "Muon", "MuonConfig", "newton_schulz", "SCHEMAS"]
