"""Hugging Face Llama export and import: transformers' LlamaForCausalLM gives our logits, and a run can
start from HF weights (init_from)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainer.checkpoint import save_checkpoint
from trainer.checkpoint.hf import export_state_dict, export_trainer, main, read_hf_config
from trainer.config import compose
from trainer.models import build_model
from trainer.models.llama import LlamaConfig
from trainer.models.llama.hf_adapter import LlamaHFAdapter
from trainer.run import build_trainer

transformers = pytest.importorskip("transformers")

to_hf_name = LlamaHFAdapter().hf_name

# Grouped-query attention (4 query heads, 2 key/value heads), 2 layers, byte vocabulary.
MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=128"]
RUN = MODEL + ["trainer.seq_len=32", "trainer.global_batch_size=8", "trainer.micro_batch_size=8", "trainer.max_steps=4",
               "trainer.log_every=1", "trainer.val_every=0", "trainer.val_batches=1", "lr_schedule.warmup_steps=1",
               "data.max_bytes=200000", "trainer.peak_flops=1e12", "trainer.num_threads=1", "callbacks=none"]


def tiny(tie_embeddings: bool = False) -> LlamaConfig:
    return LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128,
                       max_seq_len=64, rope_theta=10000.0, tie_embeddings=tie_embeddings)


def hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(str(directory), torch_dtype=torch.float32,
                                                          attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_exported_model_gives_the_same_logits_in_transformers(tmp_path: Path, tie_embeddings: bool) -> None:
    torch.manual_seed(0)
    config = tiny(tie_embeddings)
    model = build_model(config)
    # trained-looking weights: norms away from 1, so a misplaced norm weight would show
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    export_state_dict(model.state_dict(), config, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLM"] and saved["num_key_value_heads"] == 2
    tokens = torch.randint(0, 256, (2, 48))
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(hf_logits(tmp_path, tokens), ours, atol=2e-5, rtol=1e-5)
    assert read_hf_config(tmp_path).tie_embeddings is tie_embeddings


def test_names_map_both_ways() -> None:
    names = build_model(tiny()).state_dict().keys()
    hf = {to_hf_name(n) for n in names}
    assert "model.layers.1.self_attn.k_proj.weight" in hf and "lm_head.weight" in hf
    assert {LlamaHFAdapter().our_name(n) for n in hf} == {(n, None) for n in names}


def test_a_run_starts_from_hf_weights_and_exports_them_back(tmp_path: Path) -> None:
    """init_from=HF_DIR loads the weights (step 0, fresh optimizer); the first training loss is the loss
    transformers computes on the first batch; the trained model exports back from the trainer and
    from its checkpoint identically."""
    torch.manual_seed(1)
    config = tiny()
    source = build_model(config)
    export_state_dict(source.state_dict(), config, tmp_path / "hf")

    trainer = build_trainer(compose(RUN + ["model.max_seq_len=64", f"init_from={tmp_path / 'hf'}"]), tmp_path / "run")
    assert trainer.step == 0
    for key, value in source.state_dict().items():
        torch.testing.assert_close(trainer.model_parts[0].state_dict()[key], value, atol=0, rtol=0)
    position = trainer.train_loader.state_dict()
    ((inputs, targets),) = next(trainer.train_loader)  # the first step's batch (one micro-batch of 8)
    trainer.train_loader.load_state_dict(position)
    expected = F.cross_entropy(hf_logits(tmp_path / "hf", inputs).flatten(0, 1), targets.flatten()).item()
    trainer.fit()
    with open(tmp_path / "run" / "metrics.csv") as f:
        first_loss = float(next(r for r in csv.DictReader(f) if r.get("train_loss"))["train_loss"])
    assert first_loss == pytest.approx(expected, rel=1e-5)

    export_trainer(trainer, tmp_path / "exported")
    checkpoint = save_checkpoint(trainer, tmp_path / "run" / "checkpoints" / "step_00000004")
    main(["export", str(checkpoint), str(tmp_path / "converted")])
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "exported" / "model.safetensors"))
    converted = load_file(str(tmp_path / "converted" / "model.safetensors"))
    trained = trainer.model_parts[0].state_dict()
    assert exported.keys() == converted.keys() == {to_hf_name(k) for k in trained}
    for key, value in trained.items():
        assert torch.equal(exported[to_hf_name(key)], value) and torch.equal(converted[to_hf_name(key)], value)


def test_the_converter_finds_adapters_through_the_families() -> None:
    """By config instance, by a manifest's config class name and by a config.json model_type; GPT declares
    none, and the error says so."""
    from trainer.checkpoint.hf import adapter_for
    from trainer.checkpoint.manifest import CheckpointError
    from trainer.models import FAMILIES, GPTConfig

    llama = FAMILIES["llama"].hf_adapter
    assert isinstance(llama, LlamaHFAdapter)
    assert adapter_for(tiny()) is adapter_for(class_name="LlamaConfig") is adapter_for(model_type="mixtral") is llama
    assert adapter_for(model_type="qwen3_moe") is FAMILIES["qwen3"].hf_adapter
    with pytest.raises(CheckpointError, match="the gpt family declares no Hugging Face adapter"):
        adapter_for(GPTConfig())
    with pytest.raises(CheckpointError, match="model_type='bert' has no Hugging Face counterpart"):
        adapter_for(model_type="bert")


def test_mixtral_names_map_both_ways() -> None:
    adapter = LlamaHFAdapter()
    assert adapter.hf_name("layers.0.feed_forward.router.weight") == "model.layers.0.block_sparse_moe.gate.weight"
    assert adapter.stacked_hf_names("layers.1.feed_forward.experts.w2", 2) == [
        "model.layers.1.block_sparse_moe.experts.0.w2.weight", "model.layers.1.block_sparse_moe.experts.1.w2.weight"]
    assert adapter.our_name("model.layers.1.block_sparse_moe.experts.1.w2.weight") == ("layers.1.feed_forward.experts.w2", 1)
    assert adapter.our_name("model.layers.0.block_sparse_moe.gate.weight") == ("layers.0.feed_forward.router.weight", None)
    assert adapter.fused_hf_tensor("layers.1.feed_forward.experts.w2") is None
