"""The ready-made recipes (recipes/*.yaml, `recipe=NAME`): each is what its comment says, fits its target
hardware according to the planner, and, shrunk to a tiny model and 2 CPU processes, trains 2 steps."""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path

import pytest
from omegaconf import DictConfig

from tests.launch_pool import POOL
from trainer.config import RECIPES_DIR, compose, data_parallel_size, validate
from trainer.planner import plan

RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
EXPECTED = {"llama2_7b_finetune_4xa100", "llama3_8b_8xh100", "llama2_70b_64xh100", "llama3_70b_64xh100",
            "budget_10b_2xrtx3090", "gpt3_175b_256xa100", "llama3_405b_1024xh100", "tiny_3d_cpu",
            "llama3_8b_128k_64xh100", "mixtral_8x7b_64xh100", "qwen3_8b_8xh100", "qwen3_235b_a22b_128xh100",
            "deepseek_v3_671b_256xh100", "llama2_7b_1xh100_offload"}
# What a plan needs besides the recipe: the fine-tune reads no weights to plan.
PLAN_EXTRA = {"llama2_7b_finetune_4xa100": ["init_from=null"]}


@functools.lru_cache(maxsize=None)
def _recipe(name: str, plan_mode: bool = False) -> DictConfig:
    """The composed recipe (composed once per test module: composition costs a third of a second)."""
    return compose([f"recipe={name}"] + PLAN_EXTRA.get(name, []) + (["mode=plan"] if plan_mode else []))


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def test_every_recipe_is_a_global_override_file_naming_its_hardware_and_batch_arithmetic() -> None:
    assert set(RECIPES) == EXPECTED
    for name in RECIPES:
        text = (RECIPES_DIR / f"{name}.yaml").read_text()
        assert text.startswith("# @package _global_\n"), name
        assert re.search(r"^  - override /hardware: \w+$", text, re.M), f"{name} names no hardware"
        cfg = _recipe(name)
        t = cfg.trainer
        # "Batch arithmetic: ... micro-batch B x M <accumulation steps | pipeline micro-batches>
        #  = G sequences of S tokens"
        arithmetic = re.search(r"Batch arithmetic:(.*?)(?:\n(?!#)|\Z)", text, re.S)
        assert arithmetic, f"{name} explains no batch arithmetic"
        words = " ".join(line.lstrip("# ") for line in arithmetic.group(1).splitlines())
        micro = re.search(r"micro-batch (\d+) x (\d+) (?:accumulation steps|pipeline micro-batches)", words)
        total = re.search(r"= ([\d,]+) sequences of ([\d,]+) tokens", words)
        assert micro and total, (name, words)
        dp = data_parallel_size(cfg)
        assert _number(micro.group(1)) == t.micro_batch_size, name
        assert _number(micro.group(1)) * _number(micro.group(2)) * dp == t.global_batch_size, name
        assert (_number(total.group(1)), _number(total.group(2))) == (t.global_batch_size, t.seq_len), name
        tokens = re.search(r"= ([\d,]+) tokens per (?:optimizer )?step", words)
        if tokens:
            assert _number(tokens.group(1)) == t.global_batch_size * t.seq_len, name


@pytest.mark.parametrize("name", RECIPES)
def test_planner_says_each_recipe_fits_its_target_hardware(name: str) -> None:
    cfg = _recipe(name, plan_mode=True)
    validate(cfg)
    result = plan(cfg, exact=False, search=False)
    assert result.fits, (name, result.shortfall)
    assert result.hardware == cfg.hardware.name and result.world_size == cfg.trainer.devices * cfg.trainer.num_nodes
    assert result.memory["total"] <= result.capacity_bytes
    assert 0 < result.mfu < 1 and result.step_time_s > 0


# Shrunk to 2 CPU processes (one launch for all: a process costs seconds to start) and a tiny model; everything
# else as the recipe says (strategy, data-parallel flavour, precision, checkpointing, schedule, offload). The
# 3d recipes keep one of their dimensions at 2, chosen so that the set covers tensor parallelism with sequence
# parallelism, interleaved pipelines and sharded or replicated data parallelism.
TINY_LLAMA = ["model=tiny", "model.name=tiny", "model.n_kv_heads=2"]
# Mixtral stays a Mixture of Experts (8 experts, top-2), shrunk like the others.
TINY_MOE = ["model=tiny_moe", "model.name=tiny_moe", "model.n_kv_heads=2", "model.moe_hidden_dim=32"]
# Qwen3 stays Qwen3 (q/k norms, its own head width), the MoE one with its 8 experts, top-2, shrunk like the others.
TINY_QWEN3 = ["model=qwen3_tiny", "model.name=qwen3_tiny", "model.n_kv_heads=2", "model.head_dim=16"]
TINY_QWEN3_MOE = ["model=qwen3_moe_tiny", "model.name=qwen3_moe_tiny", "model.n_kv_heads=2", "model.head_dim=16",
                  "model.moe_hidden_dim=32"]
# DeepSeek-V3 stays DeepSeek-V3 (latent attention, a dense first layer, sigmoid-routed experts, MTP), at the
# tiny config's latent widths.
TINY_DEEPSEEK_V3 = ["model=deepseek_v3_tiny", "model.name=deepseek_v3_tiny", "model.q_lora_rank=32",
                    "model.kv_lora_rank=16", "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8",
                    "model.v_head_dim=16", "model.moe_hidden_dim=32", "model.max_seq_len=16"]
# GPT-3 stays GPT (fused head-major qkv, biases, learned positions, dropout 0.1), shrunk in place.
TINY_GPT = ["model.name=tiny_gpt", "model.max_seq_len=16"]
TINY = ["model.n_layers=4", "model.vocab_size=256", "model.dim=64", "model.n_heads=4",
        "model.ffn_hidden_dim=128", "trainer.devices=2", "trainer.num_nodes=1",
        "trainer.seq_len=16", "trainer.micro_batch_size=1", "trainer.global_batch_size=8", "trainer.max_steps=2",
        "trainer.val_every=0", "trainer.val_batches=1", "trainer.log_every=1", "data.max_bytes=200000",
        "lr_schedule.warmup_steps=1", "callbacks=none", "init_from=null"]
SCALED = {
    "llama2_70b_64xh100": ["tp=2"],  # tensor + sequence parallel
    "llama3_70b_64xh100": ["tp=1"],  # FSDP over 2 data-parallel ranks
    "gpt3_175b_256xa100": ["tp=2", "pp=1"],  # GPT blocks under tensor + sequence parallelism, bf16_true masters
    "llama3_405b_1024xh100": ["tp=1", "pp=2"],  # interleaved 1F1B, 2 virtual stages per rank
    "tiny_3d_cpu": ["tp=1", "pp=2"],  # 1F1B
    "llama3_8b_128k_64xh100": ["tp=1", "cp=2"],  # ring attention over 2 ranks, FSDP over the cp ranks
    "mixtral_8x7b_64xh100": ["ep=2"],  # experts split over the 2 ranks, zero3 for the rest
    "qwen3_235b_a22b_128xh100": ["ep=2"],
    "deepseek_v3_671b_256xh100": ["ep=2"],  # the MTP module's experts too
}
TINY_MODELS = {"gpt": TINY_GPT, "mixtral": TINY_MOE, "qwen3_235b": TINY_QWEN3_MOE, "qwen3": TINY_QWEN3,
               "deepseek_v3": TINY_DEEPSEEK_V3}


def _tiny_model(name: str) -> list[str]:
    return next((tiny for prefix, tiny in TINY_MODELS.items() if name.startswith(prefix)), TINY_LLAMA)


POOL.add("recipes", 2, [{"name": name, "overrides": [f"recipe={name}", *_tiny_model(name), *TINY,
                                                       *SCALED.get(name, [])]} for name in RECIPES])


@pytest.fixture(scope="module")
def tiny_runs() -> Path:
    return POOL.ensure(2, "recipes") / "np2"


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_shrunk_to_a_tiny_model_trains_2_steps_on_2_cpu_processes(tiny_runs: Path, name: str) -> None:
    summary = json.loads((tiny_runs / name / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["world_size"] == 2
    assert math.isfinite(summary["final_train_loss"]) and math.isfinite(summary["final_val_loss"])
    config = (tiny_runs / name / "config.yaml").read_text()
    recipe = _recipe(name)
    for group in ("precision", "activation_checkpointing"):  # the recipe's choices were the ones run
        assert f"_target_: {recipe[group]._target_}" in config, (name, group)
    assert f"_target_: {recipe.strategy._target_}" in config
    assert f"_target_: {recipe.model._target_}" in config  # the recipe's model family (GPT stays GPT)
