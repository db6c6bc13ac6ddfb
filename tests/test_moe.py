"""Mixture of Experts (`model.n_experts`, trainer/models/moe.py): exact parameter counts, the router, the
balancing losses and their gradients, capacity dropping, grouped vs per-expert compute, metrics, config
round trips; expert parallelism's parity with one process in one batched gloo launch (slow)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from trainer.config import compose
from trainer.models import build_meta_model, build_model
from trainer.models.llama import LlamaConfig
from trainer.models.moe import MoE, aux_loss_grad_scale_set, collect_moe_stats, update_router_biases
from tests.launch_pool import POOL
# imported at collection: the module registers its runs with the launch pool when it is first imported
from tests.test_stabilizer import StandIn, stabilizer


def small_config(**overrides: object) -> LlamaConfig:
    base = dict(name="moe_test", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64,
                max_seq_len=64, n_experts=4, top_k=2, moe_hidden_dim=16)
    base.update(overrides)
    return LlamaConfig(**base)  # type: ignore[arg-type]


# ---- counts ----------------------------------------------------------------------------------------------
def test_mixtral_8x7b_counts_exactly_its_total_and_active_parameters() -> None:
    model = build_meta_model(OmegaConf.to_object(compose(["model=mixtral_8x7b"]).model))
    assert model.num_params() == 46_702_792_704
    assert model.num_active_params() == 12_879_925_248
    # FLOPs count the active matmul weights (2 of 8 experts), as MFU must.
    dense_part = model.num_matmul_params()
    assert dense_part == 12_879_925_248 - 2 * 32_000 * 4_096 + 32_000 * 4_096 - 32 * 2 * 4096 - 4096


def test_a_dense_model_has_all_its_parameters_active() -> None:
    model = build_meta_model(OmegaConf.to_object(compose(["model=tiny"]).model))
    assert model.num_active_params() == model.num_params()


# ---- router --------------------------------------------------------------------------------------------
def test_routing_is_mixtral_softmax_top2_renormalised() -> None:
    torch.manual_seed(0)
    moe = MoE(16, 8, n_experts=4, top_k=2)
    moe.init_weights(0.5, 0.5)
    x = torch.randn(10, 16)
    logits, probs, chosen, weights = moe.route(x)
    expected = F.softmax(x @ moe.router.weight.t(), dim=-1)
    top, index = expected.topk(2, dim=-1)
    torch.testing.assert_close(probs, expected)
    assert torch.equal(chosen, index)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))


def test_top1_weights_are_not_renormalised() -> None:
    moe = MoE(8, 8, n_experts=4, top_k=1)
    moe.init_weights(0.5, 0.5)
    _, probs, chosen, weights = moe.route(torch.randn(6, 8))
    torch.testing.assert_close(weights, probs.gather(-1, chosen))


def _naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """A loop over tokens: the definition the grouped compute must reproduce."""
    _, _, chosen, weights = moe.route(x)
    out = torch.zeros_like(x)
    e = moe.experts
    for t in range(x.shape[0]):
        for slot in range(moe.top_k):
            i = int(chosen[t, slot])
            h = F.silu(x[t] @ e.w1[i].t()) * (x[t] @ e.w3[i].t())
            out[t] += weights[t, slot] * (h @ e.w2[i].t())
    return out


@pytest.mark.parametrize("grouped", [True, False])
def test_grouped_and_per_expert_compute_equal_a_loop_over_tokens(grouped: bool) -> None:
    torch.manual_seed(1)
    moe = MoE(16, 8, n_experts=4, top_k=2, grouped_mm=grouped)
    moe.init_weights(0.3, 0.3)
    x = torch.randn(24, 16)
    torch.testing.assert_close(moe(x), _naive_moe(moe, x), rtol=1e-5, atol=1e-6)


def test_grouped_matmul_and_per_expert_matmuls_give_the_same_model_and_gradients() -> None:
    torch.manual_seed(2)
    grouped = build_model(small_config(moe_grouped_mm=True))
    looped = build_model(small_config(moe_grouped_mm=False))
    looped.load_state_dict(grouped.state_dict())
    tokens = torch.randint(0, 64, (2, 16))
    losses = []
    for model in (grouped, looped):
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    for (name, a), b in zip(grouped.named_parameters(), looped.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)


# ---- balancing losses -------------------------------------------------------------------------------------
def test_the_aux_losses_reach_the_router_gradient_with_the_strategy_scale() -> None:
    """The aux loss enters through the autograd node, scaled like the LM loss: its gradient equals that of
    scale * (f(out) + coef * aux + zcoef * z) computed explicitly."""
    torch.manual_seed(3)
    moe = MoE(16, 8, n_experts=4, top_k=2, aux_loss_coef=0.3, z_loss_coef=0.05)
    moe.init_weights(0.5, 0.5)
    x = torch.randn(20, 16)
    with aux_loss_grad_scale_set(0.25):
        (moe(x).pow(2).sum() * 0.25).backward()
    got = moe.router.weight.grad.clone()
    moe.router.weight.grad = None
    moe.eval()  # no attached aux loss: add it by hand
    for module in moe.experts.parameters():
        module.grad = None
    logits, probs, chosen, _ = moe.route(x)
    counts = torch.bincount(chosen.reshape(-1), minlength=4).float()
    aux = 4 * torch.sum(counts / (20 * 2) * probs.mean(0))
    z = torch.logsumexp(logits, -1).pow(2).mean()
    (0.25 * (moe(x).pow(2).sum() + 0.3 * aux + 0.05 * z)).backward()
    torch.testing.assert_close(got, moe.router.weight.grad, rtol=1e-5, atol=1e-7)


def test_the_aux_loss_is_one_when_balanced_and_e_over_k_when_collapsed() -> None:
    moe = MoE(4, 4, n_experts=4, top_k=1)
    moe.init_weights(0.1, 0.1)
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(4) * 10)  # token i -> expert i
    moe(torch.eye(4) .repeat(2, 1))
    assert moe.stat_aux == pytest.approx(1.0, rel=1e-3)
    moe.reset_stats()
    moe(torch.eye(4)[:1].repeat(8, 1))  # every token -> expert 0
    assert moe.stat_aux == pytest.approx(4.0, rel=1e-3)


def test_capacity_drops_and_counts_the_overflow_and_dropless_keeps_everything() -> None:
    moe = MoE(4, 4, n_experts=4, top_k=1, capacity_factor=1.0)
    moe.init_weights(0.1, 0.1)
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(4) * 10)
    x = torch.eye(4)[:1].repeat(8, 1)  # 8 tokens for expert 0, capacity ceil(1.0 * 8 / 4) = 2
    out = moe(x)
    assert moe.stat_dropped == 6
    assert torch.count_nonzero(out.abs().sum(-1)) == 2  # the first two tokens only
    moe.capacity_factor = 0.0
    moe.reset_stats()
    assert torch.count_nonzero(moe(x).abs().sum(-1)) == 8 and moe.stat_dropped == 0


def test_aux_loss_free_bias_moves_towards_underloaded_experts_and_changes_only_the_choice() -> None:
    moe = MoE(4, 4, n_experts=4, top_k=1, bias_update_rate=0.5)
    moe.init_weights(0.1, 0.1)
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(4))
    x = torch.eye(4)[:1].repeat(8, 1)
    moe(x)
    metrics, loads = collect_moe_stats([moe], lambda t: t)
    assert metrics["moe/max_load"] == pytest.approx(4.0)
    update_router_biases([moe], loads)
    assert moe.expert_bias.tolist() == [-0.5, 0.5, 0.5, 0.5]
    _, probs, chosen, weights = moe.route(x)
    assert int(chosen[0, 0]) != 0  # the bias moved the choice off the overloaded expert...
    torch.testing.assert_close(weights, probs.gather(-1, chosen))  # ...but not the weights


def test_statistics_skip_evaluation_and_are_cleared_when_read() -> None:
    moe = MoE(8, 8, n_experts=4, top_k=2)
    moe.init_weights(0.1, 0.1)
    moe.eval()
    moe(torch.randn(5, 8))
    assert moe.stat_calls == 0
    moe.train()
    moe(torch.randn(5, 8))
    metrics, _ = collect_moe_stats([moe], lambda t: t)
    assert set(metrics) >= {"moe/aux_loss", "moe/z_loss", "moe/max_load", "moe/dropped"}
    assert moe.stat_calls == 0


# ---- config (the CLI's errors for bad MoE options: tests/test_invalid_inputs.py) ---------------------------
def test_moe_config_round_trips_through_dataclasses() -> None:
    config = small_config(router_bias_update_rate=1e-3)
    assert LlamaConfig(**dataclasses.asdict(config)) == config


# ---- expert parallelism and composition: parity with one process (batched gloo launches) -----------------
MOE = ["model=tiny_moe", "model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
       "model.n_experts=4", "model.moe_hidden_dim=32", "model.n_shared_experts=1", "model.router_z_loss_coef=0.001"]
# 8 steps (validation at 4 and 8): a wrong route, shard or reduction moves the loss from the first step
STEPS = 8
LOOP = ["trainer.seq_len=32", "trainer.global_batch_size=16", f"trainer.max_steps={STEPS}", "trainer.log_every=1",
        "trainer.val_every=4", "trainer.val_batches=1", "lr_schedule.warmup_steps=2", "data.max_bytes=1000000",
        "callbacks=none"]
ZBV = ["strategy.schedule=zbv", "strategy.virtual_stages=2"]
DUALPIPEV = ["strategy.schedule=dualpipev", "strategy.virtual_stages=2"]
# name: (overrides, processes, micro-batch). The aux loss is a per-micro-batch statistic, so each run is
# compared with the single process of the same micro-batch size (the same global batch).
PARITY = {
    "ep2_ddp": (["strategy=ddp", "ep=2"], 2, 8),
    "ep2_zero1": (["strategy=zero1", "ep=2"], 2, 8),
    "ep2_zero2": (["strategy=zero2", "ep=2"], 2, 8),
    "ep2_zero3": (["strategy=zero3", "ep=2"], 2, 8),
    "tp2": (["strategy=tp", "tp=2"], 2, 8),
    "pp2": (["strategy=pp", "pp=2"], 2, 8),
    # the sequences cut over 2 cp ranks, which are also the ep ranks (experts borrow dp x cp); the balancing
    # loss spans the whole sequences, so it is the single process's
    "cp2_x_ep2_zero3": (["strategy=zero3", "cp=2", "ep=2"], 2, 8),
    "ep4_ddp": (["strategy=ddp", "ep=4"], 4, 4),
    # ep with tensor and pipeline parallelism (3d): experts over ep=2 of the dp=2 ranks, whole on each tp
    # rank, in each pipeline stage
    "tp2_x_ep2_3d_zero1": (["strategy=3d", "tp=2", "ep=2", "strategy.data_parallel=zero1"], 4, 8),
    "pp2_x_ep2_3d_fsdp": (["strategy=3d", "pp=2", "ep=2", "strategy.data_parallel=fsdp"], 4, 4),
    # experts over ep=2, each expert shard FSDP-sharded over the 2 ranks left; other weights over all 4
    "zero3_dp2_x_ep2": (["strategy=zero3", "ep=2"], 4, 4),
    # the V schedules (two stages per rank, rank 0 holds the first and the last): ZBV and DualPipeV at pp=2
    # (micro-batch 4: 4 pipeline micro-batches, DualPipeV's minimum 2 pp), both at tp=2 x pp=2, and with data
    # parallelism at pp=2 x dp=2: ZBV under ddp (micro-batch 4: 2 pipeline micro-batches), DualPipeV under fsdp
    # with the experts over ep=2 of the dp ranks (micro-batch 2: 4 pipeline micro-batches)
    "pp2_zbv": (["strategy=pp", "pp=2", *ZBV], 2, 4),
    "pp2_dualpipev": (["strategy=pp", "pp=2", *DUALPIPEV], 2, 4),
    "tp2_x_pp2_3d_zero1_zbv": (["strategy=3d", "tp=2", "pp=2", "strategy.data_parallel=zero1", *ZBV], 4, 4),
    "tp2_x_pp2_3d_zero1_dualpipev": (["strategy=3d", "tp=2", "pp=2", "strategy.data_parallel=zero1", *DUALPIPEV], 4, 4),
    "pp2_x_dp2_3d_ddp_zbv": (["strategy=3d", "pp=2", "strategy.data_parallel=ddp", *ZBV], 4, 4),
    # (and DualPipeV's expert overlap: each overlapped pair's forward and backward on two threads taking turns
    # at the all-to-alls, plugins/strategies/pipeline_overlap.py)
    "pp2_x_ep2_3d_fsdp_dualpipev": (["strategy=3d", "pp=2", "ep=2", "strategy.data_parallel=fsdp", *DUALPIPEV,
                                     "strategy.expert_overlap=true"], 4, 2),
}
# Exact resume: 12 steps straight (saving at 6) vs a run resumed from step 6, both ep=2.
RESUME_AT, RESUME_END = 6, 12
RESUME_STEPS = [f"trainer.max_steps={RESUME_END}", f"trainer.val_every={RESUME_AT}"]
EP2 = ["strategy=ddp", "ep=2", "trainer.devices=2", "trainer.micro_batch_size=8"]


def _metric(run_dir: Path, name: str) -> dict[int, float]:
    import csv

    with open(run_dir / "metrics.csv") as f:
        return {int(r["step"]): float(r[name]) for r in csv.DictReader(f) if r.get(name)}


_OUT = POOL.directory("moe")
for _nproc in (2, 4):
    _batch = [{"name": name, "overrides": MOE + LOOP + strategy + [f"trainer.devices={_nproc}",
                                                                    f"trainer.micro_batch_size={micro}"]}
              for name, (strategy, procs, micro) in PARITY.items() if procs == _nproc]
    if _nproc == 2:
        _saved = _OUT / "np2" / "ep2-straight" / "checkpoints" / f"step_{RESUME_AT:08d}"
        _batch += [
            {"name": "ep2-straight", "overrides": MOE + LOOP + RESUME_STEPS + EP2 + [
                "callbacks=[checkpoint]", f"callbacks.checkpoint.every_n_steps={RESUME_AT}"]},
            {"name": "ep2-resumed", "overrides": MOE + LOOP + RESUME_STEPS + EP2 + [f"resume={_saved}"]},
        ]
    POOL.add("moe", _nproc, _batch)


@pytest.fixture(scope="module")
def moe_runs() -> Path:
    from trainer.run import build_trainer

    for nproc in (2, 4):
        out = POOL.ensure(nproc, "moe")
    for micro in sorted({micro for _, _, micro in PARITY.values()}, reverse=True):
        trainer = build_trainer(compose(MOE + LOOP + [f"trainer.micro_batch_size={micro}"]), out / f"single{micro}")
        trainer.fit()
        torch.save(trainer.strategy.full_state_dict(trainer.model_parts), out / f"single{micro}" / "weights.pt")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARITY))
def test_moe_parallelism_matches_the_single_process_run(moe_runs: Path, name: str) -> None:
    """STEPS dropless steps: per-step losses, gradient norms, aux losses and validation losses within rtol 1e-4,
    and the final weights (experts gathered from their ep ranks)."""
    _, nproc, micro = PARITY[name]
    run_dir, single = moe_runs / f"np{nproc}" / name, moe_runs / f"single{micro}"
    assert len(_metric(single, "train_loss")) == STEPS
    for metric in ("train_loss", "grad_norm", "val_loss"):
        assert _metric(run_dir, metric) == pytest.approx(_metric(single, metric), rel=1e-4), metric
    # MoE metrics: rank 0 logs every layer's, under pp too (the stages share their rows after each step)
    for metric in ["moe/aux_loss", "moe/z_loss", "moe/max_load"] + [f"moe/max_load/{i}" for i in range(4)]:
        assert _metric(run_dir, metric) == pytest.approx(_metric(single, metric), rel=1e-4), metric
    reference = torch.load(single / "weights.pt", weights_only=True)
    weights = torch.load(run_dir / "weights.pt", weights_only=True)
    assert weights.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, atol=1e-4, rtol=0, msg=f"{name}: {key}")


@pytest.mark.slow
def test_dualpipev_ran_its_pairs_on_two_threads(moe_runs: Path) -> None:
    """The parity above holds with the overlap engaged (the strategy logs it), and only where asked."""
    log = (moe_runs / "np4" / "pp2_x_ep2_3d_fsdp_dualpipev" / "train.log").read_text()
    assert "two threads that take turns at the expert all-to-alls" in log
    assert "take turns" not in (moe_runs / "np4" / "tp2_x_pp2_3d_zero1_dualpipev" / "train.log").read_text()


@pytest.mark.slow
def test_ep2_resumes_exactly_and_reshards_onto_one_process(moe_runs: Path, tmp_path: Path) -> None:
    from trainer.run import build_trainer

    straight = _metric(moe_runs / "np2" / "ep2-straight", "train_loss")
    resumed = _metric(moe_runs / "np2" / "ep2-resumed", "train_loss")
    after = range(RESUME_AT + 1, RESUME_END + 1)
    assert sorted(resumed) == list(after)
    assert [resumed[s] for s in after] == [straight[s] for s in after]  # bitwise
    saved = moe_runs / "np2" / "ep2-straight" / "checkpoints" / f"step_{RESUME_AT:08d}"
    trainer = build_trainer(compose(MOE + LOOP + RESUME_STEPS + ["trainer.micro_batch_size=8", f"resume={saved}"]),
                            tmp_path)
    assert trainer.step == RESUME_AT
    trainer.fit()
    assert _metric(tmp_path, "train_loss") == pytest.approx({s: straight[s] for s in after}, rel=1e-4)


# ---- Hugging Face Mixtral --------------------------------------------------------------------------------
def _mixtral_config() -> LlamaConfig:
    return small_config(vocab_size=256, dim=64, n_heads=4, n_kv_heads=2, n_experts=4, top_k=2, moe_hidden_dim=32,
                        ffn_hidden_dim=32, rope_theta=10000.0)


def test_exported_moe_gives_mixtral_the_same_logits_and_imports_back(tmp_path: Path) -> None:
    import transformers

    from trainer.checkpoint.hf import export_state_dict, read_hf_config

    torch.manual_seed(0)
    config = _mixtral_config()
    model = build_model(config)
    with torch.no_grad():  # trained-looking norms, so a misplaced one would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    export_state_dict(model.state_dict(), config, tmp_path / "hf")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved["architectures"] == ["MixtralForCausalLM"] and saved["num_local_experts"] == 4
    theirs = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    tokens = torch.randint(0, 256, (2, 40))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=tokens).logits, model(tokens), atol=2e-5, rtol=1e-5)
    imported = read_hf_config(tmp_path / "hf")
    assert (imported.n_experts, imported.top_k, imported.moe_hidden_dim) == (4, 2, 32)


def test_a_moe_run_starts_from_mixtral_weights_and_exports_them_back(tmp_path: Path) -> None:
    """init_from=HF_DIR (stacked experts rebuilt from Mixtral's per-expert tensors), then export before any
    step: the round trip gives back the same tensors."""
    from safetensors.torch import load_file

    from trainer.checkpoint.hf import export_state_dict, export_trainer
    from trainer.run import build_trainer

    torch.manual_seed(1)
    config = _mixtral_config()
    source = build_model(config)
    export_state_dict(source.state_dict(), config, tmp_path / "hf")
    overrides = ["model=tiny_moe", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                 "model.n_experts=4", "model.moe_hidden_dim=32", "model.max_seq_len=64", "trainer.seq_len=32",
                 "trainer.max_steps=1", "trainer.global_batch_size=4", "trainer.micro_batch_size=4",
                 "lr_schedule.warmup_steps=0", "trainer.val_batches=1", "callbacks=none",
                 "data.max_bytes=100000", f"init_from={tmp_path / 'hf'}"]
    trainer = build_trainer(compose(overrides), tmp_path / "run")
    for key, value in source.state_dict().items():
        torch.testing.assert_close(trainer.model_parts[0].state_dict()[key], value, atol=0, rtol=0, msg=key)
    export_trainer(trainer, tmp_path / "exported")
    first, second = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert first.keys() == second.keys()
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in first
    for key in first:
        assert torch.equal(first[key], second[key]), key


# ---- planner -------------------------------------------------------------------------------------------
def test_the_plan_reports_total_and_active_parameters_and_counts_expert_shards_exactly() -> None:
    """mode=plan on the Mixtral recipe: the counts, FLOPs on active parameters, the all-to-all of ep=8, and
    the per-rank model states under ep=8 x FSDP-sharded experts equal to the real model on the meta device."""
    from trainer.planner import plan

    cfg = compose(["recipe=mixtral_8x7b_64xh100", "mode=plan"])
    result = plan(cfg, exact=True, search=False)
    assert (result.num_params, result.num_active_params, result.ep) == (46_702_792_704, 12_879_925_248, 8)
    model = build_meta_model(OmegaConf.to_object(cfg.model))
    assert result.flops_per_token == model.flops_per_token(4096)
    assert result.exact is not None
    for key in ("params", "grads", "optimizer"):
        assert result.memory[key] == result.exact[key], key
    # 46.7e9 params x 4 bytes / 64 ranks, within the rounding of the sharded rows
    assert result.memory["params"] == pytest.approx(46_702_792_704 * 4 / 64, rel=1e-3)
    (a2a,) = [c for c in result.communication if c["dimension"] == "ep"]
    # 32 layers x (forward 2 + backward 2 + full recompute 2) x 4 micro-batches; 4096 tokens x top-2 x 4096 x bf16
    assert a2a["op"] == "all-to-all" and a2a["count"] == 32 * 6 * 4
    assert a2a["payload_bytes"] == 32 * 6 * 4 * 4096 * 2 * 4096 * 2


def test_the_planner_search_considers_expert_parallelism() -> None:
    from trainer.planner.layout import layout_from_config, model_config
    from trainer.planner.params import inventory
    from trainer.planner.search import candidate_layouts, family_tp_sizes
    from trainer.planner.core import hardware_from_config

    cfg = compose(["recipe=mixtral_8x7b_64xh100", "mode=plan"])
    layouts = candidate_layouts(inventory(model_config(cfg)), layout_from_config(cfg), hardware_from_config(cfg),
                                family_tp_sizes(cfg))
    assert {layout.ep for layout in layouts if layout.dp_flavour in ("ddp", "zero1", "zero2", "zero3")} == {1, 2, 4, 8}


def test_the_stabilizer_can_watch_the_aux_loss(tmp_path: Path) -> None:
    trainer, stab = StandIn(tmp_path), stabilizer(actions=["skip"], aux_loss_ratio=1.5)
    stab.on_fit_start(trainer)  # type: ignore[arg-type]

    for value in (1.1, 1.0, 1.05, 1.1, 1.0):
        assert not _attempt_with_aux(trainer, stab, value)
    assert _attempt_with_aux(trainer, stab, 2.0)  # 2.0 > 1.5 x the median 1.05
    assert stab.events[-1]["kinds"] == ["aux_loss_spike"]
    assert stab.state_dict()["aux_loss_history"] == [1.1, 1.0, 1.05, 1.1, 1.0]


def _attempt_with_aux(trainer: Any, stab: Any, aux: float) -> bool:
    """StandIn.attempt with the MoE aux loss in the step outputs, as the loop puts it there."""
    next(trainer.train_loader)
    trainer.step_outputs = {"loss": torch.tensor(2.0), "grad_norm": torch.tensor(1.0),
                            "lr": trainer.optimizer.param_groups[0]["lr"], "moe": {"moe/aux_loss": aux}}
    trainer.skip_step = False
    stab.on_before_optimizer_step(trainer, trainer.optimizer)
    if not trainer.skip_step:
        trainer.optimizer.step()
    trainer.step += 1
    stab.on_train_batch_end(trainer, {**trainer.step_outputs, "skipped": trainer.skip_step})
    return trainer.skip_step


@pytest.mark.parametrize("strategy", [["strategy=ddp"], ["strategy=zero1"], ["strategy=zero2"], ["strategy=zero3"],
                                      # 8 ranks: tp 2 x pp 2 x dp 2 with ep=2 (experts whole on each tp rank)
                                      ["strategy=3d", "tp=2", "pp=2", "strategy.data_parallel=zero1"],
                                      ["strategy=3d", "tp=2", "pp=2", "strategy.data_parallel=fsdp"]],
                         ids=["ddp", "zero1", "zero2", "zero3", "3d_zero1", "3d_fsdp"])
def test_planned_expert_shards_equal_the_real_strategy_on_the_meta_device(strategy: list[str]) -> None:
    """ep=2: experts replicated (ddp) or partitioned (zero1/zero2 states, zero3 weights) over the ranks
    left; the analytic bytes of a rank's states are what the strategy really holds."""
    from trainer.planner import plan

    devices = 8 if "strategy=3d" in strategy else 4
    cfg = compose(["model=tiny_moe", *strategy, "ep=2", f"trainer.devices={devices}", "hardware=cpu",
                   "trainer.micro_batch_size=4", "mode=plan", f"plan.rank={devices - 1}"])  # ep rank 1, edp rank 1
    result = plan(cfg, exact=True, search=False)
    assert result.exact is not None, result.exact_error
    for key in ("params", "grads", "optimizer"):
        assert result.state_bytes[key] == result.exact[key], (strategy, key)


@pytest.mark.parametrize("overrides, message", [
    (["model=tiny_moe", "strategy=ddp", "ep=3", "trainer.devices=3", "trainer.global_batch_size=24"],
     "ep=3 does not divide model.n_experts=8"),
    (["model=tiny_moe", "strategy=ddp", "ep=4", "trainer.devices=2"],
     "ep=4 does not divide the data-parallel x context-parallel size 2 x 1 = 2"),
    (["model=tiny", "strategy=ddp", "ep=2", "trainer.devices=2"], "ep=2 splits Mixture-of-Experts layers, but model tiny"),
    (["model=tiny_moe", "strategy=tp", "tp=2", "ep=2", "trainer.devices=2"], "ep=2 needs strategy=ddp, zero1"),
])
def test_bad_expert_parallel_sizes_are_config_errors(overrides: list[str], message: str) -> None:
    from trainer.config import validate
    from trainer.config.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        validate(compose(overrides))
    assert "\n" not in str(error.value)


def test_activation_checkpointing_gives_the_same_gradients_and_counts_each_forward_once() -> None:
    """A recompute runs the MoE forward again inside the backward: the aux losses' gradients are the same
    as without recomputation, and the statistics count the forward once."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(4)
    config = small_config(router_z_loss_coef=0.01)
    plain, recomputed = build_model(config), build_model(config)
    recomputed.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 64, (2, 16))
    for model, wrap in ((plain, False), (recomputed, True)):
        h = model.tok_embeddings(tokens)
        rope = model.rope_cache[:16]
        for layer in model.layers.values():
            h = checkpoint(layer, h, rope, use_reentrant=False) if wrap else layer(h, rope)
        logits = model.output(model.norm(h))
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert [layer.feed_forward.stat_calls for layer in recomputed.layers.values()] == [1, 1]
