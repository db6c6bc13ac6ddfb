"""DeepSeek-V3 (trainer/models/deepseek_v3): the same logits as transformers' DeepseekV3ForCausalLM and the same
MTP outputs as its MtpModel (through our exported checkpoint), HF export/import round trips and init_from,
exact parameter counts of the 671B model against transformers' on the meta device, FLOPs, the planner,
DeepSeekMoE routing against transformers' router, the sequence-wise balance loss, the MTP loss's gradient,
MLA's latent cache, the auxiliary-loss-free bias moving in a run, and every parallel layout (dp, ep, tp, pp,
3d, cp under both methods) against the single process."""

from __future__ import annotations

import csv
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from tests.launch_pool import POOL
from trainer.checkpoint.hf import export_state_dict, export_trainer, read_hf_config
from trainer.config import ConfigError, compose, validate
from trainer.models import build_meta_model
from trainer.models.deepseek_v3 import DeepSeekV3, DeepSeekV3Config
from trainer.models.deepseek_v3.hf_adapter import DeepSeekV3HFAdapter
from trainer.models.deepseek_v3.mla import deinterleave
from trainer.models.deepseek_v3.moe import DeepSeekMoE
from trainer.models.moe import aux_loss_grad_scale_set, collect_moe_stats

transformers = pytest.importorskip("transformers")

# MLA with low-rank queries, a dense first layer, MoE layers of 4 groups of 2 experts (top-2 from the 2 best
# groups), a shared expert, one MTP depth; every width distinct so that a transposed or swapped weight shows.
TINY = dict(name="ds_test", vocab_size=256, dim=64, n_layers=3, n_heads=4, q_lora_rank=32, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, ffn_hidden_dim=96, first_k_dense_replace=1,
            n_experts=8, top_k=2, n_shared_experts=1, moe_hidden_dim=24, n_group=4, topk_group=2,
            routed_scaling_factor=2.5, mtp_depth=1, max_seq_len=64, yarn_factor=1.0, init_std=0.1)
# YaRN as transformers reads it: factor x original = max_position_embeddings; mscale != mscale_all_dim, so
# both the cos/sin factor and the softmax scale differ from 1.
YARN = dict(yarn_factor=4.0, yarn_original_max_seq_len=16, yarn_mscale=1.0, yarn_mscale_all_dim=0.8)
# A training run of the tiny config, small enough for a test.
RUN = ["model=deepseek_v3_tiny", "model.dim=64", "model.q_lora_rank=32", "model.kv_lora_rank=16",
       "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8", "model.v_head_dim=16", "model.ffn_hidden_dim=128",
       "model.moe_hidden_dim=32", "model.max_seq_len=64", "trainer.seq_len=32", "trainer.global_batch_size=8",
       "trainer.micro_batch_size=4", "trainer.log_every=1", "trainer.val_every=0", "trainer.val_batches=1",
       "lr_schedule.warmup_steps=1", "data.max_bytes=200000", "trainer.peak_flops=1e12", "trainer.num_threads=1",
       "callbacks=none"]


def tiny(**overrides: Any) -> DeepSeekV3Config:
    return DeepSeekV3Config(**{**TINY, **overrides})  # type: ignore[arg-type]


def trained_looking(config: DeepSeekV3Config, seed: int = 0) -> DeepSeekV3:
    """A model whose norms are not all ones and whose selection biases are not zero (so a misplaced norm or
    an ignored bias would show)."""
    torch.manual_seed(seed)
    model = DeepSeekV3(config)
    model.init_weights()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.uniform_(-0.05, 0.05)
    return model


def hf_model(directory: Path) -> Any:
    return transformers.DeepseekV3ForCausalLM.from_pretrained(str(directory), torch_dtype=torch.float32,
                                                              attn_implementation="eager").eval()


# ---- transformers parity -----------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["plain", "yarn", "full_rank_q", "no_shared_one_group"])
def test_exported_model_gives_transformers_the_same_logits(tmp_path: Path, variant: str) -> None:
    """Our model and transformers' DeepseekV3ForCausalLM loaded from our export, fp32: max |diff| 3.1e-6 (plain),
    3.0e-6 (YaRN), 3.2e-6 (full-rank q), 4.0e-6 (one group, no shared expert) on logits of magnitude ~3."""
    overrides = {"plain": {}, "yarn": YARN, "full_rank_q": {"q_lora_rank": None},
                 "no_shared_one_group": {"n_shared_experts": 0, "n_group": 1, "topk_group": 1}}[variant]
    config = tiny(**overrides)
    model = trained_looking(config).eval()
    export_state_dict(model.state_dict(), config, tmp_path)
    theirs = hf_model(tmp_path)
    tokens = torch.randint(0, 256, (2, 48))
    with torch.no_grad():
        expected, ours = theirs(input_ids=tokens).logits, model(tokens)
    print(f"{variant}: max |logits diff| = {(expected - ours).abs().max().item():.3g}")
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_mtp_module_matches_transformers_mtp_model(tmp_path: Path) -> None:
    """transformers' MtpModel, loaded through its own conversion mapping from our export (DeepSeek's
    checkpoint layout: model.layers.<n_layers>.enorm/hnorm/eh_proj/shared_head.norm + a decoder block), gives
    our depth-1 logits from the same main-model hidden states: max |diff| 2.0e-6."""
    from transformers.modeling_layers import MtpModel

    config = tiny()
    model = trained_looking(config).eval()
    export_state_dict(model.state_dict(), config, tmp_path)
    main = hf_model(tmp_path)
    # transformers finds the MTP weights by the main model's ignored keys, which it hard-codes for the
    # 61-layer DeepSeek-V3 (`model.layers.61.*`): point it at this model's MTP layer.
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{config.n_layers}\..*"]
    mtp = MtpModel.from_pretrained(main, device_map={"": "cpu"}).eval()
    tokens = torch.randint(0, 256, (2, 24))
    length = tokens.shape[1] - 2  # depth 1 predicts token i + 2 for the positions that have it
    with torch.no_grad():
        ours = model.mtp_logits(tokens)[0]
        hidden = main.model(input_ids=tokens).last_hidden_state
        positions = torch.arange(length)[None].expand(2, -1)
        theirs = mtp._project_to_logits(mtp.forward_layer(0, hidden[:, :length], positions, None,
                                                          input_ids=tokens[:, 1:1 + length]))
    print(f"MTP: max |logits diff| = {(theirs - ours).abs().max().item():.3g}")
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_the_router_is_transformers_group_limited_sigmoid_router() -> None:
    """Chosen experts and gates equal DeepseekV3TopkRouter's (sigmoid scores, bias for the choice only,
    top-2-sum group scores, topk_group groups, renormalised, times routed_scaling_factor)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(3)
    config = tiny(n_experts=16, n_group=4, topk_group=2, top_k=3)
    moe = DeepSeekMoE(64, 24, 16, 3, shared_experts=None, n_group=4, topk_group=2, norm_topk_prob=True,
                      routed_scaling_factor=2.5, bias_update_rate=0.001, seq_aux_loss_coef=0.0)
    moe.init_weights(0.3, 0.3)
    hf_config = transformers.DeepseekV3Config(**{k: v for k, v in DeepSeekV3HFAdapter().hf_config(config).items()
                                                 if k not in ("architectures", "model_type", "torch_dtype")})
    router = DeepseekV3TopkRouter(hf_config)
    with torch.no_grad():
        moe.expert_bias.uniform_(-0.2, 0.2)
        router.weight.copy_(moe.router.weight)
        router.e_score_correction_bias.copy_(moe.expert_bias)
    x = torch.randn(200, 64)
    _, scores, chosen, weights = moe.route(x)
    _, hf_weights, hf_chosen = router(x)
    order, hf_order = chosen.sort(-1), hf_chosen.sort(-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(weights.gather(-1, order.indices), hf_weights.gather(-1, hf_order.indices))
    torch.testing.assert_close(weights.sum(-1), torch.full((200,), 2.5))  # renormalised, then scaled
    # the group stage matters here: plain top-k over all experts would often pick from a third group
    plain = (scores + moe.expert_bias).topk(3, dim=-1).indices
    assert not torch.equal(plain.sort(-1).values, order.values)
    groups = chosen // 4
    assert all(len(set(row.tolist())) <= 2 for row in groups)


def test_group_limiting_excludes_the_best_expert_of_a_weak_group() -> None:
    """Hand-made choice scores: group 0 holds the single best expert but a weak second one, so its top-2 sum
    loses to groups 1 and 2, and its best expert is not chosen (plain top-2 would choose it)."""
    moe = DeepSeekMoE(4, 8, 8, 2, shared_experts=None, n_group=4, topk_group=2, norm_topk_prob=True,
                      routed_scaling_factor=1.0, bias_update_rate=0.0, seq_aux_loss_coef=0.0)
    choice = torch.tensor([0.98, 0.02, 0.73, 0.72, 0.71, 0.70, 0.05, 0.05])  # group sums 1.0, 1.45, 1.41, 0.1
    with torch.no_grad():
        moe.router.weight.zero_()  # every affinity sigmoid(0) = 0.5: the bias alone decides
        moe.expert_bias.copy_(choice - 0.5)
    _, scores, chosen, weights = moe.route(torch.zeros(1, 4))
    assert sorted(chosen[0].tolist()) == [2, 3]
    assert sorted((scores + moe.expert_bias).topk(2).indices[0].tolist()) == [0, 2]
    torch.testing.assert_close(weights, torch.full((1, 2), 0.5))  # gates from the affinities, not the bias


def test_sequence_wise_balance_loss() -> None:
    """Eq. 17-20 per sequence, averaged over sequences; 1.0 when balanced; its weight alpha trains the router."""
    torch.manual_seed(0)
    moe = DeepSeekMoE(16, 8, 4, 2, shared_experts=None, n_group=1, topk_group=1, norm_topk_prob=True,
                      routed_scaling_factor=1.0, bias_update_rate=0.0, seq_aux_loss_coef=0.1)
    moe.init_weights(0.5, 0.5)
    x = torch.randn(3, 10, 16)
    _, scores, chosen, _ = moe.route(x.reshape(-1, 16))
    expected = 0.0
    for s in range(3):
        sc, ch = scores[s * 10:(s + 1) * 10], chosen[s * 10:(s + 1) * 10]
        f = torch.bincount(ch.reshape(-1), minlength=4).float() * 4 / (2 * 10)
        p = (sc / sc.sum(-1, keepdim=True)).mean(0)
        expected += float((f * p).sum().detach()) / 3
    counts = torch.bincount(chosen.reshape(-1), minlength=4)
    assert moe.balance_loss(counts, scores, 30, chosen=chosen, seq_len=10).item() == pytest.approx(expected, rel=1e-6)
    uniform = torch.full((10, 4), 0.5)
    balanced = torch.tensor([[0, 1], [2, 3]] * 5)
    assert moe.balance_loss(counts, uniform, 10, chosen=balanced, seq_len=10).item() == pytest.approx(1.0)
    moe.train()
    with aux_loss_grad_scale_set(1.0):
        moe(x).sum().mul(0).backward()  # only the balance loss reaches the router
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0


# ---- Hugging Face import / export ------------------------------------------------------------------------
def test_export_and_import_round_trip_exactly(tmp_path: Path) -> None:
    """Our names <-> the published layout (experts split, MTP as model.layers.<n_layers>.*, copies of the
    shared embedding and head), config.json back to the same config."""
    from safetensors.torch import load_file

    config = tiny(**YARN)
    model = trained_looking(config)
    export_state_dict(model.state_dict(), config, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in tensors
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in tensors
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.shared_head.norm.weight",
            "model.layers.3.embed_tokens.weight", "model.layers.3.mlp.experts.0.gate_proj.weight"} <= tensors.keys()
    adapter = DeepSeekV3HFAdapter()
    imported = read_hf_config(tmp_path)
    assert dataclasses.replace(imported, name=config.name, init_std=config.init_std) == config
    for key, value in model.state_dict().items():
        stacked = adapter.stacked_hf_names(key, value.shape[0]) if value.ndim else None
        theirs = torch.stack([tensors[name] for name in stacked]) if stacked else tensors[adapter.hf_name(key)]
        assert torch.equal(theirs, value), key
    published = json.loads((tmp_path / "config.json").read_text())
    assert published["rope_scaling"]["type"] == "yarn" and published["num_nextn_predict_layers"] == 1


def test_a_run_starts_from_a_transformers_save_and_keeps_training(tmp_path: Path) -> None:
    """init_from=DIR written by transformers' own save_pretrained (its fused expert layout, no MTP layer):
    the main weights load exactly, the MTP keeps its initialization, training runs and lowers the loss; the
    trained model exports back and imports again bit for bit."""
    from trainer.run import build_trainer

    cfg = compose(RUN + ["trainer.max_steps=6"])
    config = OmegaConf.to_object(cfg.model)
    source = trained_looking(config, seed=5)
    export_state_dict(source.state_dict(), config, tmp_path / "ours")
    hf_model(tmp_path / "ours").save_pretrained(str(tmp_path / "hf"))
    trainer = build_trainer(compose(RUN + ["trainer.max_steps=6", f"init_from={tmp_path / 'hf'}"]), tmp_path / "run")
    state = trainer.model_parts[0].state_dict()
    for key, value in source.state_dict().items():
        if not key.startswith("mtp."):
            assert torch.equal(state[key], value), key
    trainer.fit()
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train_loss")]
    losses = [float(r["train_loss"]) for r in rows]
    assert len(losses) == 6 and losses[-1] < losses[0]
    export_trainer(trainer, tmp_path / "exported")
    again = build_trainer(compose(RUN + ["trainer.max_steps=6", f"init_from={tmp_path / 'exported'}"]), tmp_path / "run2")
    for key, value in trainer.model_parts[0].state_dict().items():
        assert torch.equal(again.model_parts[0].state_dict()[key], value), key


def test_init_from_another_architecture_is_refused(tmp_path: Path) -> None:
    from trainer.checkpoint import CheckpointError
    from trainer.run import build_trainer

    config = tiny(kv_lora_rank=24)
    export_state_dict(trained_looking(config).state_dict(), config, tmp_path / "hf")
    with pytest.raises(CheckpointError, match="kv_lora_rank=24 vs 16"):
        build_trainer(compose(RUN + [f"init_from={tmp_path / 'hf'}"]), tmp_path / "run")


# ---- counts -----------------------------------------------------------------------------------------------
def _published_hf_config() -> Any:
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    return transformers.DeepseekV3Config(rope_parameters=rope, max_position_embeddings=163840)


def test_671b_counts_equal_transformers_on_the_meta_device() -> None:
    """num_params() = transformers' DeepseekV3ForCausalLM (no MTP) = 671,026,404,352; the MTP module
    = transformers' MtpModel's own weights (embedding and head shared) = 11,610,067,968."""
    from transformers.modeling_layers import MtpModel

    cfg = compose(["model=deepseek_v3_671b"])
    ours = build_meta_model(OmegaConf.to_object(cfg.model))
    assert DeepSeekV3HFAdapter().config_from_hf(DeepSeekV3HFAdapter().hf_config(ours.config), "deepseek_v3_671b") \
        == dataclasses.replace(ours.config, init_std=0.006)
    with torch.device("meta"):
        theirs = transformers.DeepseekV3ForCausalLM(_published_hf_config())
        mtp = MtpModel(theirs, 1)
    hf_main = sum(p.numel() for p in theirs.parameters())
    hf_mtp = sum(p.numel() for name, p in mtp.named_parameters() if not name.startswith(("embed_tokens", "shared_head")))
    assert ours.num_params() == hf_main == 671_026_404_352
    assert ours.num_params(include_mtp=True) - ours.num_params() == hf_mtp == 11_610_067_968
    # the published "14B" MTP module also counts the checkpoint's copies of the embedding and head
    assert hf_mtp + 2 * 129_280 * 7_168 == 13_463_426_048
    counted = build_meta_model(dataclasses.replace(ours.config, count_mtp_params=True))
    assert counted.num_params() == 671_026_404_352 + 11_610_067_968


def _active_and_matmul_by_hand(c: DeepSeekV3Config) -> tuple[int, int, int, int]:
    """(active params, MTP active params, matmul weights per token, MTP matmul weights) from the config."""
    h, heads, qk = c.dim, c.n_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    q = h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * heads * qk
    kv = h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
    attention = q + kv + heads * c.v_head_dim * h
    attention_matmul = attention - c.q_lora_rank - c.kv_lora_rank
    expert = 3 * h * c.moe_hidden_dim
    moe_active = c.n_experts * h + (c.top_k + c.n_shared_experts) * expert
    dense = 3 * h * c.ffn_hidden_dim
    n_moe = c.n_layers - c.first_k_dense_replace
    block = attention + 2 * h
    active = 2 * c.vocab_size * h + h + c.n_layers * block + c.first_k_dense_replace * dense + n_moe * moe_active
    mtp_active = 3 * h + 2 * h * h + block + moe_active
    matmul = (c.n_layers * attention_matmul + c.first_k_dense_replace * dense + n_moe * moe_active + c.vocab_size * h)
    mtp_matmul = 2 * h * h + attention_matmul + moe_active + c.vocab_size * h  # the shared head runs again
    return active, mtp_active, matmul, mtp_matmul


def test_active_parameters_and_flops_per_token_follow_the_shapes() -> None:
    """37,552,282,624 active per token (embedding and head included); FLOPs = 6 x matmul weights (MTP's
    included) + 6 x (layers + MTP) x s x heads x (qk 192 + v 128)."""
    model = build_meta_model(OmegaConf.to_object(compose(["model=deepseek_v3_671b"]).model))
    c = model.config
    active, mtp_active, matmul, mtp_matmul = _active_and_matmul_by_hand(c)
    assert model.num_active_params() == active == 37_552_282_624
    assert model.num_active_params(include_mtp=True) == active + mtp_active
    assert model.num_matmul_params() == matmul + mtp_matmul
    attention = 6 * (61 + 1) * 4096 * 128 * (192 + 128)
    assert model.flops_per_token(4096) == 6 * (matmul + mtp_matmul) + attention == 291_847_274_496


@pytest.mark.parametrize("count_mtp", [False, True])
def test_the_plan_prints_the_exact_counts(count_mtp: bool) -> None:
    """mode=plan on deepseek_v3_671b: the inventory's counts and FLOPs equal the model's, and its parameter
    bytes are every held weight (MTP included) x 4 bytes (fp32), as exact mode measures on the meta model."""
    from trainer.planner import plan
    from trainer.planner.report import format_table

    cfg = compose(["model=deepseek_v3_671b", "mode=plan", f"model.count_mtp_params={str(count_mtp).lower()}"])
    validate(cfg)
    result = plan(cfg, exact=not count_mtp, search=False)  # exact mode (the real meta model) once
    model = build_meta_model(OmegaConf.to_object(cfg.model))
    assert (result.num_params, result.num_active_params) == (model.num_params(), model.num_active_params())
    assert result.num_params == (682_636_472_320 if count_mtp else 671_026_404_352)
    assert result.flops_per_token == model.flops_per_token(int(cfg.trainer.seq_len))
    assert result.memory["params"] == model.num_params(include_mtp=True) * 4
    if not count_mtp:
        assert result.exact is not None and result.exact["params"] == result.memory["params"]
    text = format_table(result)
    assert ("682.636 B parameters" if count_mtp else "671.026 B parameters, 37.552 B active per token") in text


@pytest.mark.parametrize("method", ["ring", "all_to_all"])
def test_the_planner_counts_mla_widths_and_the_mtp_block_in_the_cp_traffic(method: str) -> None:
    """cp=2: the ring's K/V blocks carry keys of width qk_head_dim (48) and values of v_head_dim (32) for the
    4 heads, all_to_all exchanges q and k (48), v and the output (32); the MTP block attends across the
    ranks as the 3 main blocks do (no checkpointing: one forward and one backward each)."""
    from trainer.planner import plan

    cfg = compose(["model=deepseek_v3_tiny", "strategy=ddp", "trainer.devices=2", "cp=2", f"cp_method={method}",
                   "trainer.seq_len=256", "trainer.micro_batch_size=8", "trainer.global_batch_size=16",
                   "precision=fp32", "mode=plan"])
    result = plan(cfg, exact=False, search=False)
    traffic = [c for c in result.communication if c["dimension"] == "cp"]
    tokens, microbatches, blocks, width = 128 * 8, 2, 3 + 1, 4 * (48 + 32)
    if method == "ring":  # one hop of 2 ranks per block and pass, then the fp32 gradients' 2 hops
        assert [c["count"] for c in traffic] == [microbatches * 2 * blocks, microbatches * 2 * blocks]
        assert traffic[0]["payload_bytes"] == microbatches * 2 * blocks * tokens * width * 4
        assert traffic[1]["payload_bytes"] == microbatches * 2 * blocks * tokens * width * 4
    else:  # q, k, v and the output, forward and backward
        (a2a,) = traffic
        assert a2a["count"] == 4 * microbatches * 2 * blocks
        assert a2a["payload_bytes"] == microbatches * 2 * blocks * tokens * 2 * width * 4


def test_the_planner_splits_dense_and_moe_blocks_over_pipeline_stages() -> None:
    """With blocks of two kinds, a pipeline rank holds the dense ones only when its layer range has them
    (the planner's own layout arithmetic); the last stage holds the MTP module and a copy of the embedding."""
    from trainer.planner.memory import rank_param_specs
    from trainer.planner.layout import Layout
    from trainer.planner.memory import block_param_specs
    from trainer.planner.params import inventory

    inv = inventory(tiny(n_layers=4, first_k_dense_replace=1))
    layout = Layout(world_size=2, dp_replicate=1, dp_shard=1, tp=1, pp=2, cp=1, strategy="pp", dp_flavour="none",
                    layers_per_stage=(2, 2))
    first = {p.name: n for p, n in block_param_specs(inv, layout, 0)}
    last = {p.name: n for p, n in block_param_specs(inv, layout, 1)}
    assert first["feed_forward.w1.weight"] == 1 and first["feed_forward.experts.w1"] == 1
    assert "feed_forward.w1.weight" not in last and last["feed_forward.experts.w1"] == 2
    ends = [{p.name for p, _ in rank_param_specs(inv, layout, rank)} for rank in (0, 1)]
    assert "tok_embeddings.weight" in ends[0] and not any(name.startswith("mtp.") for name in ends[0])
    assert {"tok_embeddings.weight", "output.weight", "mtp.4.eh_proj.weight"} <= ends[1]


# ---- model behaviour ------------------------------------------------------------------------------------
def test_the_mtp_loss_reaches_the_gradients_with_its_weight() -> None:
    """backward(CE(main)) in a training forward = backward(CE(main) + lambda / D x sum_k CE_k) computed by hand."""
    config = tiny(mtp_depth=2, mtp_loss_weight=0.3)
    model = trained_looking(config).train()
    tokens = torch.randint(0, 256, (2, 20))
    targets = torch.randint(0, 256, (2, 20))
    with aux_loss_grad_scale_set(1.0):
        F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    attached = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.eval()  # no attachment: the loss by hand
    mtp = model.mtp_logits(tokens)
    assert [m.shape[1] for m in mtp] == [18, 17]
    by_hand = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()) + 0.3 / 2 * sum(
        F.cross_entropy(logits.flatten(0, 1), tokens[:, k + 1:k + 1 + logits.shape[1]].flatten())
        for k, logits in enumerate(mtp, start=1))
    by_hand.backward()
    assert attached.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    assert any(n.startswith("mtp.4.") for n in attached)  # both depths trained
    for name, param in model.named_parameters():
        torch.testing.assert_close(attached[name], param.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_the_mtp_loss_is_counted_and_logged_once_per_forward() -> None:
    model = trained_looking(tiny()).train()
    tokens = torch.randint(0, 256, (2, 20))
    model(tokens)
    model(tokens)
    model.eval()
    with torch.no_grad():
        model(tokens)  # evaluation: no MTP
        expected = F.cross_entropy(model.mtp_logits(tokens)[0].flatten(0, 1), tokens[:, 2:].flatten()).item()
    metrics, loads = collect_moe_stats([model], lambda t: t)
    assert metrics["mtp/loss"] == pytest.approx(expected, rel=1e-5) == metrics["mtp/loss/1"]
    assert len(loads) == 3 and "moe/max_load/3" in metrics  # layers 1, 2 and the MTP block (key 3)
    # two forwards of 2 x 20 tokens, top-2: the MTP block counts its 18 positions with a target, not its padding
    assert [float(load.sum()) for load in loads] == [2 * 2 * 20 * 2] * 2 + [2 * 2 * 18 * 2]
    assert collect_moe_stats([model], lambda t: t)[0]["mtp/loss"] == 0.0  # cleared when read


def test_the_latent_kv_is_all_attention_needs() -> None:
    """MLA's cache: c_kv [kv_lora_rank] + the shared rotated key [qk_rope_head_dim] per token; the last token's
    attention computed from the cached latents alone equals the forward's."""
    model = trained_looking(tiny(**YARN)).eval()
    attention = model.layers["1"].attention
    x = torch.randn(2, 12, 64)
    rope = model.rope_cache[:12]
    with torch.no_grad():
        c_kv, k_rope = attention.latent_kv(x, rope)
        assert c_kv.shape == (2, 12, 16) and k_rope.shape == (2, 12, 1, 8)
        q = attention.queries(x, rope)[:, -1:]  # the newest token's query
        k_nope, v = attention.wkv_b(c_kv).view(2, 12, 4, 28).split([16, 12], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, -1, 4, -1)), dim=-1)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * model.config.softmax_scale
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(2, 1, -1)
        torch.testing.assert_close(attention.wo(out)[:, 0], attention(x, rope)[:, -1], atol=1e-6, rtol=1e-5)
    assert model.config.softmax_scale == pytest.approx(24 ** -0.5 * (0.1 * 0.8 * torch.log(torch.tensor(4.0)).item() + 1) ** 2)


def test_deinterleaving_is_transformers_interleaved_rope() -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    from trainer.models.llama import apply_rope

    x = torch.randn(1, 5, 3, 8)
    angles = torch.outer(torch.arange(5.0), torch.rand(4))
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos(), emb.sin()
    theirs, _ = apply_rotary_pos_emb_interleave(x.transpose(1, 2), x.transpose(1, 2), cos[None], sin[None])
    torch.testing.assert_close(apply_rope(deinterleave(x), torch.cat((cos, sin), -1)), theirs.transpose(1, 2))


def test_one_document_gives_the_plain_forward() -> None:
    model = trained_looking(tiny()).train()
    tokens = torch.randint(0, 256, (2, 16))
    with aux_loss_grad_scale_set(1.0):
        plain = model(tokens)
        masked = model(tokens, torch.zeros_like(tokens))
    torch.testing.assert_close(plain, masked, atol=1e-5, rtol=1e-5)


# ---- training ----------------------------------------------------------------------------------------------
def test_tiny_trains_moves_the_selection_biases_and_logs_the_mtp_loss(tmp_path: Path) -> None:
    """model=deepseek_v3_tiny, single process: the loss falls, mtp/loss is logged every step, and each MoE
    layer's selection bias (MTP block included) has moved by +-gamma per step, outside the gradient."""
    from trainer.run import build_trainer

    trainer = build_trainer(compose(RUN + ["trainer.max_steps=8"]), tmp_path)
    model = trainer.model_parts[0]
    biases = {name: b for name, b in model.named_buffers() if name.endswith("expert_bias")}
    assert set(biases) == {"layers.1.feed_forward.expert_bias", "layers.2.feed_forward.expert_bias",
                           "mtp.3.block.feed_forward.expert_bias"}
    assert all(not b.requires_grad and not b.any() for b in biases.values())
    trainer.fit()
    with open(tmp_path / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train_loss")]
    losses = [float(r["train_loss"]) for r in rows]
    assert len(rows) == 8 and losses[-1] < losses[0] - 0.5
    assert all(float(r["mtp/loss"]) > 0 for r in rows)
    assert float(rows[-1]["mtp/loss"]) < float(rows[0]["mtp/loss"])
    for name, bias in biases.items():
        assert bias.abs().max() > 0, name
        # sign steps of gamma = 0.001: every entry is a multiple of it, at most 8 steps away from 0
        steps = bias / 0.001
        torch.testing.assert_close(steps, steps.round(), atol=1e-3, rtol=0)
        assert steps.abs().max() <= 8


def test_every_parallel_layout_validates_and_cp_refuses_only_what_its_layout_cannot_cut() -> None:
    """dp, ep, tp, pp and cp under both methods pass validation (`unsupported_parallelism` refuses nothing);
    what cp still refuses is its methods' own limits, as for every family: all_to_all needs the 4 heads
    divisible by tp x cp, the ring a sequence of 2 x cp chunks."""
    for fine in (["strategy=ddp"], ["strategy=zero3", "ep=2"], ["strategy=tp", "tp=2"], ["strategy=pp", "pp=2"],
                 ["strategy=ddp", "cp=2"], ["strategy=ddp", "cp=2", "cp_method=all_to_all"],
                 ["strategy=zero3", "cp=2", "ep=2"]):
        validate(compose(["model=deepseek_v3_tiny", "trainer.devices=2", *fine]))
    with pytest.raises(ConfigError, match="model.n_heads=4 is not divisible by tp x cp = 1 x 8") as error:
        validate(compose(["model=deepseek_v3_tiny", "trainer.devices=8", "strategy=ddp", "cp=8",
                          "cp_method=all_to_all"]))
    assert error.value.key == "cp"
    with pytest.raises(ConfigError, match="cannot be cut into 2 x cp = 8 chunks") as error:
        validate(compose(["model=deepseek_v3_tiny", "trainer.devices=4", "strategy=ddp", "cp=4",
                          "trainer.seq_len=36"]))
    assert error.value.key == "trainer.seq_len"


def test_under_cp_rope_and_the_mtp_tokens_are_this_ranks_part_of_the_whole_sequence() -> None:
    """With each sequence split over 2 ranks (ring layout: chunks r and 3 - r of 4): a rank's RoPE rows are
    those of its tokens' global positions, its MTP depth-k inputs and targets its part of the whole
    sequence's shifted ones (t_{i+k}, and t_{i+k+1} with the last k + 1 ignored), and the length checked
    against max_seq_len is the whole sequence's."""
    from trainer.loss import IGNORE_INDEX
    from trainer.models.context_parallel import ContextParallel, shard_sequence

    model = trained_looking(tiny(mtp_depth=2))
    tokens = torch.arange(1, 2 * 16 + 1).view(2, 16)
    whole = {depth: model.mtp_tokens(tokens, depth) for depth in (1, 2)}
    inputs, targets = whole[2]
    assert inputs[0].tolist() == [*range(3, 17), 0, 0] and targets[0].tolist() == [*range(4, 17), *[IGNORE_INDEX] * 3]
    for rank in (0, 1):
        model.context_parallel = ContextParallel(None, rank, 2, "ring")  # type: ignore[arg-type]
        positions = shard_sequence(torch.arange(16)[None], rank, 2, True)[0]
        assert torch.equal(model._rope(8, None), model.rope_cache[positions])
        for depth, (inputs, targets) in whole.items():
            mine = model.mtp_tokens(tokens, depth)
            assert torch.equal(mine[0], shard_sequence(inputs, rank, 2, True))
            assert torch.equal(mine[1], shard_sequence(targets, rank, 2, True))
        with pytest.raises(ValueError, match="sequence length 66 exceeds max_seq_len 64"):
            model._rope(33, None)


@pytest.mark.parametrize("layer", ["deepseek", "switch"])
def test_padding_is_left_out_of_the_routing_statistics_and_the_balance_loss(layer: str) -> None:
    """`counted`: an MoE layer run on sequences of 10 whose last 3 tokens are padding counts, logs and
    trains exactly what it does on the 7-token sequences alone (loads, the balance loss and its gradient,
    the z statistic), and its outputs at the counted positions are those: DeepSeekMoE with its sequence-wise
    loss, and the base layer's batch-wise (Switch) loss."""
    from trainer.models.moe import MoE

    layers = []
    for _ in range(2):
        torch.manual_seed(0)
        moe = (DeepSeekMoE(16, 8, 4, 2, shared_experts=None, n_group=1, topk_group=1, norm_topk_prob=True,
                           routed_scaling_factor=1.0, bias_update_rate=0.001, seq_aux_loss_coef=0.1)
               if layer == "deepseek" else MoE(16, 8, 4, 2, aux_loss_coef=0.1, z_loss_coef=0.01))
        moe.init_weights(0.5, 0.5)
        layers.append(moe.train())
    padded, alone = layers
    x = torch.randn(3, 10, 16)
    counted = (torch.arange(10) < 7).expand(3, -1)
    with aux_loss_grad_scale_set(1.0):
        out = padded(x, counted=counted)
        out[:, :7].sum().backward()
        expected = alone(x[:, :7])
        expected.sum().backward()
    torch.testing.assert_close(out[:, :7], expected)
    assert torch.equal(padded.stat_tokens, alone.stat_tokens) and float(alone.stat_tokens.sum()) == 3 * 7 * 2
    assert padded.stat_aux == pytest.approx(alone.stat_aux, rel=1e-6)
    assert padded.stat_z == pytest.approx(alone.stat_z, rel=1e-6)
    torch.testing.assert_close(padded.router.weight.grad, alone.router.weight.grad, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("override, message", [
    ("model.n_group=3", "divisible by model.n_group"),
    ("model.topk_group=5", "topk_group=5"),
    ("model.mtp_loss_weight=0", "mtp_loss_weight must be > 0"),
    ("model.qk_rope_head_dim=7", "even model.qk_rope_head_dim"),
])
def test_bad_options_are_config_errors(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(compose(["model=deepseek_v3_tiny", override]))


DATA_PARALLEL = ("ddp", "zero1", "zero2", "zero3", "fsdp")
# the routed experts of the 3 MoE layers (2 of the main model, the MTP module's) split over the 2 ranks
EXPERT_PARALLEL = {"ep2_ddp": ["strategy=ddp", "ep=2"], "ep2_zero3": ["strategy=zero3", "ep=2"]}
# MLA split by heads (latents whole on each rank, the shared rotary key's gradient summed over them), the MoEs
# whole on each rank, the MTP block split as the main ones; sequence parallel
TENSOR_PARALLEL = {"tp2": ["strategy=tp", "tp=2"]}
# blocks 0-1 on the first stage, block 2, the head and the MTP module on the last, which holds a copy of the
# embedding (broadcast from the first stage, gradients summed) and gets the token ids of each micro-batch
PIPELINE_PARALLEL = {"pp2": ["strategy=pp", "pp=2"]}
# each sequence split over 2 ranks (trainer.seq_len=32 divides by 2 x cp): MLA's core attention across them
# (ring: keys of width 24 and values of width 16 travel round together, MLA's softmax scale; all_to_all: 2 of
# the 4 heads per rank), RoPE at the global positions, the MTP depth on this rank's part of the whole
# sequence's shifted tokens, the routing statistics (the logged sequence-wise balance loss) of whole sequences
CONTEXT_PARALLEL = {"cp2_ring": ["strategy=ddp", "cp=2"],
                    "cp2_all_to_all": ["strategy=ddp", "cp=2", "cp_method=all_to_all"]}
MODEL_PARALLEL = {**TENSOR_PARALLEL, **PIPELINE_PARALLEL, **CONTEXT_PARALLEL}
_PARALLEL_RUN = [a for a in RUN if not a.startswith(("trainer.micro_batch_size", "trainer.num_threads"))] + [
    "trainer.max_steps=4", "trainer.micro_batch_size=2", "trainer.num_threads=1"]
_LAYOUTS = {**{strategy: [f"strategy={strategy}"] for strategy in DATA_PARALLEL}, **EXPERT_PARALLEL, **MODEL_PARALLEL}
# Packed documents (tests/test_documents.py's: 3 to 40 tokens) kept apart, the sequence-wise balance loss
# trained (alpha 0.1), two MTP depths and YaRN (MLA's softmax scale then differs from qk_head_dim^-0.5),
# under cp=2 (both methods) against one process with the same options
_DOCUMENTS = POOL.directory("deepseek_v3") / "documents"
_DOCUMENT_RUN = [a for a in _PARALLEL_RUN if not a.startswith("data.")] + [
    "data=token_file", f"data.path={_DOCUMENTS}", "data.document_masking=true", "model.seq_aux_loss_coef=0.1",
    "model.mtp_depth=2", "model.yarn_factor=4.0", "model.yarn_original_max_seq_len=16",
    "model.yarn_mscale_all_dim=0.8"]
DOCUMENTS_CONTEXT_PARALLEL = {"docs_seq_aux_cp2_ring": ["strategy=ddp", "cp=2"],
                              "docs_seq_aux_cp2_all_to_all": ["strategy=ddp", "cp=2", "cp_method=all_to_all"]}


def _write_documents() -> None:
    from tests.test_documents import write_documents

    if not _DOCUMENTS.exists():
        write_documents(_DOCUMENTS)


# the V placement (pp=2, two stages per rank: 4 blocks, so rank 0 holds the embedding, the first and the last
# block, the head and the MTP module) under both V schedules
V_RUN = [*_PARALLEL_RUN, "model.n_layers=4"]
V_PIPELINE = {f"pp2_{schedule}": ["strategy=pp", "pp=2", f"strategy.schedule={schedule}", "strategy.virtual_stages=2"]
              for schedule in ("zbv", "dualpipev")}
POOL.add("deepseek_v3", 2, [{"name": name, "overrides": [*layout, "trainer.devices=2", *_PARALLEL_RUN]}
                            for name, layout in _LAYOUTS.items()]
         + [{"name": name, "overrides": [*layout, "trainer.devices=2", *V_RUN]} for name, layout in V_PIPELINE.items()]
         + [{"name": name, "overrides": [*layout, "trainer.devices=2", *_DOCUMENT_RUN]}
            for name, layout in DOCUMENTS_CONTEXT_PARALLEL.items()], prepare=_write_documents)
# in the shared 4-process launch: both splits at once (sequence parallel: the last stage, which holds an
# embedding copy, still takes hidden states), and cp=2 x pp=2 (the last stage gathers its micro-batch's token
# ids over the cp ranks for the MTP depth)
THREE_D = {"3d_tp2_pp2": ["strategy=3d", "tp=2", "pp=2", "strategy.data_parallel=zero1", "trainer.devices=4"],
           "cp2_pp2": ["strategy=pp", "pp=2", "cp=2", "trainer.devices=4"]}
POOL.add("deepseek_v3", 4, [{"name": name, "overrides": [*layout, *_PARALLEL_RUN]} for name, layout in THREE_D.items()])


@pytest.mark.slow
def test_data_parallel_strategies_reproduce_the_single_process_run(tmp_path: Path) -> None:
    """ddp, zero1, zero2, zero3 and fsdp on 2 gloo processes, and ep=2 under ddp and zero3: the same losses,
    gradient norms and MTP losses as one process (measured: at most 4.2e-7 relative over 4 steps, ep2_zero3
    the farthest), and the expert-parallel runs end with the ddp run's weights (measured: 2.9e-6 apart at
    most) and its selection biases exactly (the loads are averaged over the ranks before each update).
    The model-parallel runs within the issue's 1e-4: tp=2 (measured 3.0e-7 relative, weights 7.3e-6 from
    ddp's) and pp=2 under 1f1b (the MTP module on the last stage with its copy of the embedding:
    losses equal, grad norms 1.8e-7 and mtp/loss 4.8e-8 relative, weights 1.4e-7 from ddp's; without the
    sum of the two embedding copies' gradients 9 of the 12 values differ, without the MTP losses' sum over
    the stages rank 0 logs mtp/loss 0). 3d tp=2 x pp=2 (zero1, 4 processes) the same way. cp=2 under both
    methods the same way (ring: grad norms 7.3e-8, mtp/loss 3.6e-8 relative, weights 4.1e-6 from ddp's;
    all_to_all: 7.8e-8, 4.6e-8, 2.8e-6; cp=2 x pp=2 on 4 processes: 1.2e-7, 4.6e-8, 4.1e-6; losses
    equal), and the cp=2 runs' logged sequence-wise balance loss and loads are the single process's (2.8e-8
    and 3.8e-8 relative; loads equal): without the balance loss's sum over the cp ranks it is off by 1e-3 to
    6e-3. (The tiny config's softmax scale is qk_head_dim^-0.5, the ring's default: the YaRN runs of the
    next test check that the ring uses MLA's own.)"""
    from trainer.run import build_trainer

    launched = POOL.ensure(2, "deepseek_v3") / "np2"
    launched_4 = POOL.ensure(4, "deepseek_v3") / "np4"
    build_trainer(compose(_PARALLEL_RUN), tmp_path / "single").fit()
    rows = {}
    runs = {"single": tmp_path / "single", **{n: launched / n for n in _LAYOUTS}, **{n: launched_4 / n for n in THREE_D}}
    for name, run_dir in runs.items():
        rows[name] = _metric_rows(run_dir, ("train_loss", "grad_norm", "mtp/loss"))
    assert len(rows["single"]) == 3 * 4
    for name in (*_LAYOUTS, *THREE_D):
        model_parallel = name in MODEL_PARALLEL or name in THREE_D
        assert rows[name] == pytest.approx(rows["single"], rel=1e-4 if model_parallel else 1e-5), name
    # every layer's routing statistics, as the single process logs them: under pp, the stages' rows shared;
    # under cp, those of whole sequences (per-shard ones would log another sequence-wise balance loss;
    # padding counted in the MTP block's loads would move its max load)
    routing = ("moe/aux_loss", "moe/max_load/1", "moe/max_load/2", "moe/max_load/3")
    for name in (*_LAYOUTS, *THREE_D):
        assert _metric_rows(runs[name], routing) == pytest.approx(_metric_rows(runs["single"], routing), rel=1e-4), name
    reference = torch.load(launched / "ddp" / "weights.pt", weights_only=True)
    biases = [key for key in reference if key.endswith("expert_bias")]
    assert biases == ["layers.1.feed_forward.expert_bias", "layers.2.feed_forward.expert_bias",
                      "mtp.3.block.feed_forward.expert_bias"]
    assert all(reference[key].abs().max() > 0 for key in biases)  # they moved
    # ep split the experts: under ddp each rank holds half of them (zero3 shards them over 2 ranks either way)
    held = {name: float(re.search(r"state held per rank: params ([\d.]+) MiB",
                                  (launched / name / "train.log").read_text()).group(1)) for name in ("ddp", "ep2_ddp")}
    assert held["ep2_ddp"] < 0.8 * held["ddp"], held
    for name in (*EXPERT_PARALLEL, *MODEL_PARALLEL, *THREE_D):  # (cp: RoPE at the global positions)
        weights = torch.load(runs[name] / "weights.pt", weights_only=True)
        assert weights.keys() == reference.keys(), name
        for key, value in reference.items():
            torch.testing.assert_close(weights[key], value, atol=1e-5, rtol=0, msg=f"{name}: {key}")
        assert all(torch.equal(weights[key], reference[key]) for key in biases), name


@pytest.mark.slow
def test_the_v_schedules_reproduce_the_single_process_run(tmp_path: Path) -> None:
    """ZBV and DualPipeV at pp=2 (MLA, the MoE layers, the MTP module and the embedding on rank 0's two
    stages): the single process's losses, gradient norms and MTP losses within the model-parallel 1e-4
    (measured: losses equal, gradient norms 7.4e-8 and mtp/loss 2.2e-8 relative)."""
    from trainer.run import build_trainer

    launched = POOL.ensure(2, "deepseek_v3") / "np2"
    build_trainer(compose(V_RUN), tmp_path / "single").fit()
    keys = ("train_loss", "grad_norm", "mtp/loss")
    expected = _metric_rows(tmp_path / "single", keys)
    assert len(expected) == 3 * 4
    for name in V_PIPELINE:
        assert _metric_rows(launched / name, keys) == pytest.approx(expected, rel=1e-4), name


def _metric_rows(run_dir: Path, keys: tuple[str, ...]) -> list[float]:
    """`keys`' values of every training step of a run's metrics.csv, step after step."""
    with open(run_dir / "metrics.csv") as f:
        return [float(r[key]) for r in csv.DictReader(f) if r.get("train_loss") for key in keys]


@pytest.mark.slow
def test_context_parallel_with_documents_and_the_sequence_wise_balance_loss(tmp_path: Path) -> None:
    """cp=2 under both methods with document masking (the ring's document masks over MLA's widths, RoPE
    positions restarting at each document), YaRN (MLA's softmax scale, which the ring must use), the
    sequence-wise balance loss trained (its per-sequence statistics summed over the cp ranks, each rank's
    affinities getting their share of the gradient) and two MTP depths (each on this rank's part of the
    whole sequence's shifted tokens, the padding past the window's end left out of the routing
    statistics): the single process's losses, gradient norms, MTP and balance losses and loads within the
    model-parallel 1e-4 (measured 1.9e-7 at most), its selection biases exactly, and its weights within
    1e-4, as tests/test_context_parallel.py allows (measured 7.2e-6 ring, 6.5e-6 all_to_all; without YaRN
    the ring's were 7.7e-6 but for 2 of the 16,384 elements of one expert's w3, 3.6e-5 apart: Adam's
    m / sqrt(v) amplifies the rounding of a gradient element near 0, and with SGD every weight agreed
    within 7.5e-9). With the ring's default scale (qk_head_dim^-0.5) instead of MLA's, the ring run's
    losses are 1.9e-4 off, its gradient norms 6.0e-3, its weights 1.2e-2."""
    from trainer.run import build_trainer

    launched = POOL.ensure(2, "deepseek_v3") / "np2"
    single = build_trainer(compose(_DOCUMENT_RUN), tmp_path / "single")
    single.fit()
    reference = single.strategy.full_state_dict(single.model_parts)
    keys = ("train_loss", "grad_norm", "mtp/loss", "mtp/loss/1", "mtp/loss/2", "moe/aux_loss", "moe/max_load/1",
            "moe/max_load/2", "moe/max_load/3", "moe/max_load/4")
    expected = _metric_rows(tmp_path / "single", keys)
    assert len(expected) == 4 * len(keys)
    for name in DOCUMENTS_CONTEXT_PARALLEL:
        assert _metric_rows(launched / name, keys) == pytest.approx(expected, rel=1e-4), name
        weights = torch.load(launched / name / "weights.pt", weights_only=True)
        assert weights.keys() == reference.keys(), name
        for key, value in reference.items():
            if key.endswith("expert_bias"):
                assert torch.equal(weights[key], value) and value.abs().max() > 0, f"{name}: {key}"
            else:
                torch.testing.assert_close(weights[key], value, atol=1e-4, rtol=0, msg=f"{name}: {key}")


@pytest.mark.parametrize("q_lora_rank", [64, None])
def test_the_planner_counts_what_multi_head_latent_attention_saves_for_backward(q_lora_rank: int | None) -> None:
    """The activation model's MLA terms (trainer/planner/activations.py `mla_saved_tensors`) against what a
    dense DeepSeek-V3 block saves for its backward, fp32 on the CPU (storages counted once, parameters and
    buffers excluded), with a query latent and without one (full-rank queries): equal to the byte, for the
    attention half and for the whole block. The CPU's fused SDPA kernel needs one head width for q, k and
    v, so this attention (value width 32, query/key width 48) takes the math path: the scores are saved."""
    from trainer.planner.activations import block_inventory, layer_bytes, mla_saved_tensors, saved_tensors
    from trainer.planner.layout import model_config
    from trainer.planner.params import inventory

    cfg = compose(["model=deepseek_v3_tiny", f"model.q_lora_rank={'null' if q_lora_rank is None else q_lora_rank}"])
    config = model_config(cfg)
    torch.manual_seed(0)
    model = DeepSeekV3(config)
    model.init_weights()
    block = model.layers["0"]  # first_k_dense_replace = 1: a dense SwiGLU block
    excluded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}

    def saved_bytes(forward: Any) -> int:
        storages: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            key = tensor.untyped_storage().data_ptr()
            if key not in excluded:
                storages[key] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            forward()
        return sum(storages.values())

    batch, seq = 2, 64
    x = torch.randn(batch, seq, config.dim, requires_grad=True)
    rope = model._rope(seq, None)
    attention = saved_bytes(lambda: block.attention(block.attention_norm(x), rope))
    whole = saved_bytes(lambda: block(x, rope, None))
    inv = block_inventory(inventory(config), 0)  # the dense block's widths
    estimated_attention = mla_saved_tensors(inv, seq, batch, 4, 4, casts=False, fused_norm=False, materialized=True)
    assert sum(t.bytes(1, False) for t in estimated_attention if "none" in t.kept_by) == attention
    tensors = saved_tensors(inv, seq, batch, 4, 4, materialized=True, residual_bytes=4, fused_norm=False)
    assert layer_bytes(tensors, "none", 1, False) == whole


def test_the_planner_counts_the_multi_token_prediction_modules_activations() -> None:
    """The MTP module runs outside the checkpointed blocks and computes its loss in the forward: under full
    activation checkpointing it keeps all its block saves, its norms and the fp32 log-probabilities of its
    head (`mtp_saved_tensors`). What the model with mtp_depth=1 saves beyond the same model without it, fp32
    on the CPU: measured 2,680,992 bytes, estimated 2,729,472 (+1.8%; the depth runs on all 64 positions,
    the last 2 padding); 6% allowed. (When the depth ran on its 62 positions with a target: measured
    2,528,280, estimated +4.6%, an MoE block's shapes scaled to 61 of 64 positions.) Before the MTP terms
    the estimate counted none of it (-100%); before the MoE layer's dispatch terms, -11.0%."""
    from hydra.utils import instantiate

    from trainer.loss import cross_entropy_loss
    from trainer.planner.activations import estimate_activations
    from trainer.planner.layout import layout_from_config, model_config
    from trainer.planner.params import inventory
    from trainer.plugins.activation_checkpointing.accounting import SavedActivationMeter

    measured, estimated = {}, {}
    for depth in (0, 1):
        cfg = compose(["model=deepseek_v3_tiny", f"model.mtp_depth={depth}", "trainer.micro_batch_size=2",
                       "trainer.seq_len=64", "trainer.global_batch_size=2", "activation_checkpointing=full"])
        torch.manual_seed(0)
        model = DeepSeekV3(model_config(cfg))
        model.init_weights()
        meter = SavedActivationMeter.applying(instantiate(cfg.activation_checkpointing), model)
        tokens = torch.randint(0, 256, (2, 64))
        with meter:
            cross_entropy_loss(model(tokens), tokens)
        measured[depth] = meter.bytes
        estimated[depth] = estimate_activations(inventory(model_config(cfg)), layout_from_config(cfg), 0, "cpu").device
    assert estimated[0] == pytest.approx(measured[0], rel=0.01)  # the blocks' inputs and the head: -0.2%
    assert estimated[1] - estimated[0] == pytest.approx(measured[1] - measured[0], rel=0.06)
