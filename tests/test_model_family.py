"""The model-family contract (`trainer.interfaces.ModelFamily`): strategies, activation checkpointing, the
planner and the Hugging Face converter ask a model's family and never name the model's attributes, so a
family whose modules are named otherwise is split, checkpointed and tensor-parallelised by the same code.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from trainer.interfaces.model_family import BlockSplit, ModelFamily, StageModules
from trainer.models import FAMILIES, build_model, family_of
from trainer.models.decoder import pre_norm_block_split
from trainer.models.llama import LlamaConfig, TransformerBlock, compute_rope_cache
from trainer.models.llama.family import GQA_COLUMN, GQA_ROW, gqa_sizes

ROOT = Path(__file__).resolve().parent.parent

# ---- 1. nothing outside the families names a model's attributes (read from the source) -------------------
# Modules of the strategies, the activation checkpointing, the loop and the converter: no attribute access
# with one of these names, no string naming a weight path, no import of a family's module.
CONTRACT_USERS = [*sorted((ROOT / "plugins").rglob("*.py")), ROOT / "trainer" / "loop.py",
                  ROOT / "trainer" / "checkpoint" / "hf.py", ROOT / "trainer" / "interfaces" / "strategy.py",
                  ROOT / "trainer" / "interfaces" / "activation_checkpointing.py"]
PLANNER = sorted((ROOT / "trainer" / "planner").glob("*.py"))
MODEL_ATTRIBUTES = {"tok_embeddings", "pos_embeddings", "layers", "feed_forward", "attention", "attention_norm",
                    "ffn_norm", "wq", "wk", "wv", "wqkv", "wo", "w1", "w2", "w3", "wq_a", "wq_b", "wkv_a", "wkv_b",
                    "q_norm", "k_norm", "kv_norm", "mtp", "router", "shared_experts", "norm", "output", "eh_proj",
                    "first_stage_modules", "last_stage_modules"}
WEIGHT_PATH = re.compile(r"\b(tok_embeddings|pos_embeddings|feed_forward|attention|layers|mtp|output|norm)\.\w")
FAMILY_MODULE = re.compile(r"^trainer\.models\.(llama|gpt|qwen3|deepseek_v3)\b")


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def model_names(path: Path, attributes: bool) -> list[str]:
    """Where `path` names a model attribute (with `attributes`), a weight path or a family's module."""
    tree = ast.parse(path.read_text())
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if attributes and isinstance(node, ast.Attribute) and node.attr in MODEL_ATTRIBUTES:
            found.append(f"{where} .{node.attr}")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
              and WEIGHT_PATH.search(node.value)):
            found.append(f"{where} {node.value!r}")
        elif isinstance(node, ast.ImportFrom) and FAMILY_MODULE.match(node.module or ""):
            found.append(f"{where} from {node.module} import ...")
        elif isinstance(node, ast.ImportFrom) and node.module == "trainer.models":
            found += [f"{where} imports {alias.name}" for alias in node.names
                      if alias.name.endswith("Config") or alias.name in {"Llama", "GPT", "Qwen3", "DeepSeekV3"}]
    return found


def test_no_strategy_planner_or_converter_module_names_a_model_attribute() -> None:
    # The planner's own data (`part.layers`, `inv.mtp`: counts and inventory fields) share names with model
    # attributes, so there only strings and imports are checked.
    found = [hit for path in CONTRACT_USERS for hit in model_names(path, attributes=True)]
    found += [hit for path in PLANNER for hit in model_names(path, attributes=False)]
    assert found == []


def test_the_check_sees_attribute_names_weight_paths_and_family_imports(tmp_path: Path) -> None:
    """The checker itself can fail: each kind of naming it looks for is found."""
    probe = ROOT / "tests" / "_model_family_probe.py"
    probe.write_text('"""docstring naming layers.0 is fine"""\n'
                     "from trainer.models.llama import Llama\nfrom trainer.models import LlamaConfig, family_of\n"
                     "def f(model):\n    return model.layers, 'attention.wq.weight', family_of(model)\n")
    try:
        found = model_names(probe, attributes=True)
    finally:
        probe.unlink()
    assert [hit.split(" ", 1)[1] for hit in found] == [
        "from trainer.models.llama import ...", "imports LlamaConfig", ".layers", "'attention.wq.weight'"]


def test_every_registered_family_declares_the_whole_contract() -> None:
    required = [name for name, value in vars(ModelFamily).items()
                if callable(value) and not name.startswith("_") and _raises_not_implemented(value)]
    assert {"blocks", "block_split", "parameter_inventory", "stage_modules", "tied_weights"} <= set(required)
    for family in FAMILIES.values():
        missing = [name for name in required if getattr(type(family), name) is getattr(ModelFamily, name)]
        assert missing == [], family.name
        assert family_of(family.config_class) is family


def _raises_not_implemented(function: object) -> bool:
    source = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return any(isinstance(node, ast.Raise) and "NotImplementedError" in ast.unparse(node) for node in ast.walk(source))


# ---- 2. a family with other names goes through the same strategy code -------------------------------------
@dataclass
class RenamedConfig:
    """A Llama's shapes, for a model that names its modules otherwise."""

    llama: LlamaConfig

    @property
    def n_layers(self) -> int:
        return self.llama.n_layers


class Renamed(nn.Module):
    """A Llama whose top-level modules are `embed`, `stack`, `final` and `lm_head`; a pipeline stage sets
    the ones it lacks to None and takes hidden states."""

    def __init__(self, config: RenamedConfig) -> None:
        super().__init__()
        cfg = config.llama
        self.config = config
        self.embed: Optional[nn.Embedding] = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.stack = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.final: Optional[nn.RMSNorm] = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head: Optional[nn.Linear] = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("rope", compute_rope_cache(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) if self.embed is not None else tokens
        rope = self.rope[:h.shape[1]]  # under sequence parallelism h is a DTensor of the global shape
        for block in self.stack.values():
            h = block(h, rope)
        h = self.final(h) if self.final is not None else h
        return self.lm_head(h) if self.lm_head is not None else h


class RenamedFamily(ModelFamily):
    name = "renamed"
    config_class = RenamedConfig
    model_class = Renamed

    def blocks(self, model: nn.Module) -> nn.ModuleDict:
        return model.stack  # type: ignore[return-value]

    def num_layers(self, model: nn.Module) -> int:
        return model.config.n_layers  # type: ignore[union-attr]

    def stage_only_modules(self, model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return ("embed",), ("final", "lm_head")

    def stage_modules(self, model: nn.Module) -> StageModules:
        def held(name: str) -> Optional[str]:
            return name if getattr(model, name) is not None else None

        return StageModules(embedding=held("embed"), positions=None, final_norm=held("final"), head=held("lm_head"))

    def tied_weights(self, model: nn.Module) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        return (None if model.embed is None else model.embed.weight,  # type: ignore[union-attr]
                None if model.lm_head is None else model.lm_head.weight)  # type: ignore[union-attr]

    def block_split(self, block: nn.Module) -> BlockSplit:
        return pre_norm_block_split(block, attention_args=3, column=GQA_COLUMN, row=GQA_ROW)

    def tensor_parallel_sizes(self, config: RenamedConfig) -> list[tuple[str, int, str]]:
        return gqa_sizes(config.llama)


TINY = LlamaConfig(name="renamed", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=32)


@pytest.fixture
def renamed(monkeypatch: pytest.MonkeyPatch) -> Renamed:
    monkeypatch.setitem(FAMILIES, "renamed", RenamedFamily())
    torch.manual_seed(0)
    model = Renamed(RenamedConfig(TINY))
    assert family_of(model).name == "renamed"
    return model


def test_the_pipeline_splits_a_family_by_its_declaration(renamed: Renamed) -> None:
    from trainer.plugins.strategies.pipeline_split import split_model

    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    first, last = split_model(renamed, [range(0, 1), range(1, 2)], [0, 1])
    assert (list(first.stack), first.final, first.lm_head) == (["0"], None, None)
    assert (list(last.stack), last.embed) == (["1"], None)
    torch.testing.assert_close(last(first(tokens)), renamed(tokens), rtol=0, atol=0)


def test_activation_checkpointing_wraps_the_declared_blocks(renamed: Renamed) -> None:
    from trainer.plugins.activation_checkpointing.recompute import FullCheckpointing

    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    expected = renamed(tokens)
    FullCheckpointing().apply(renamed)
    assert all(type(block).__name__ == "CheckpointWrapper" for block in renamed.stack.values())
    torch.testing.assert_close(renamed(tokens), expected, rtol=0, atol=0)


@pytest.fixture
def group_of_one() -> Iterator[None]:
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_tensor_parallelism_splits_a_family_by_its_declaration(renamed: Renamed, group_of_one: None,
                                                                sequence_parallel: bool) -> None:
    """On a tp mesh of one rank every declared role becomes its DTensor style (the plan is the same code
    path as tp > 1, which the multi-process parity tests of each family run): every parameter is a DTensor
    and the logits are the unsplit model's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from trainer.plugins.strategies.tensor_parallel_plan import apply_tensor_parallel

    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    expected = renamed(tokens)
    apply_tensor_parallel(renamed, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)),
                          sequence_parallel=sequence_parallel, loss_parallel=False)
    assert all(isinstance(p, DTensor) for p in renamed.parameters())
    torch.testing.assert_close(renamed(tokens), expected, rtol=1e-6, atol=1e-6)


def test_a_block_the_family_cannot_split_is_refused_before_anything_is_split() -> None:
    model = build_model(TINY)
    del model.layers["1"].attention.wk
    with pytest.raises(ValueError, match="has no attention.wk"):
        family_of(model).block_split(model.layers["1"])


def test_the_planner_search_splits_what_the_family_says_tp_divides() -> None:
    """DeepSeek-V3's MoE layers run whole on every tp rank: an expert width tp does not divide (90 x 3 = 270
    for the planner's MoE SwiGLU) leaves tp=4 open, since the family names only the heads, the dense MLP and
    the vocabulary; a head count it does not divide closes it."""
    from trainer.config import compose
    from trainer.planner.core import hardware_from_config
    from trainer.planner.layout import layout_from_config, model_config
    from trainer.planner.params import inventory
    from trainer.planner.search import candidate_layouts, family_tp_sizes

    def tp_sizes(*overrides: str) -> set[int]:
        cfg = compose(["model=deepseek_v3_tiny", "trainer.devices=4", "trainer.seq_len=64", "trainer.micro_batch_size=1",
                       "trainer.global_batch_size=8", "hardware.devices_per_node=4", "mode=plan", *overrides])
        layouts = candidate_layouts(inventory(model_config(cfg)), layout_from_config(cfg), hardware_from_config(cfg),
                                    family_tp_sizes(cfg))
        return {layout.tp for layout in layouts}

    assert tp_sizes("model.moe_hidden_dim=90") == {1, 2, 4}
    assert tp_sizes("model.moe_hidden_dim=90", "model.n_heads=6") == {1, 2}
