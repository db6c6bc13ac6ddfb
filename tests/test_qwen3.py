"""Qwen3, dense and MoE (trainer/models/qwen3): against transformers' Qwen3ForCausalLM and
Qwen3MoeForCausalLM (logits, the training loss with Qwen3-MoE's pooled load-balancing loss and every
gradient, parameter counts of the published configs), the Hugging Face adapter both ways (bitwise, and
`init_from=` a directory transformers saved), model FLOPs against a FLOP count, the planner, training
from the command line's configs with each activation-checkpointing policy, and what validation refuses.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.launch_pool import POOL
from trainer.checkpoint import save_checkpoint
from trainer.checkpoint.hf import export_state_dict, export_trainer, main, read_hf_config
from trainer.config import ConfigError, compose, validate
from trainer.models import Qwen3, Qwen3Config, build_meta_model, build_model
from trainer.models.qwen3 import Qwen3HFAdapter, Qwen3MoE
from trainer.planner.layout import layout_from_config, model_config
from trainer.planner.params import inventory
from trainer.run import build_trainer

transformers = pytest.importorskip("transformers")
ADAPTER = Qwen3HFAdapter()

# head_dim 32 with 4 heads on a width of 64: attention width 128 != dim, as in Qwen3; GQA 4/2; init_std 0.08
# gives logits of a few units (at 0.02 they stay below 1, which would make any difference look small).
TINY = dict(vocab_size=256, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32, ffn_hidden_dim=96,
            max_seq_len=64, rope_theta=1000000.0, init_std=0.08)
# 8 experts of width 48, top 2, layer 1 dense (mlp_only_layers) so both kinds of feed-forward are checked.
MOE = dict(n_experts=8, top_k=2, moe_hidden_dim=48, mlp_only_layers=[1], router_aux_loss_coef=0.02)
CASES = {
    "dense": dict(TINY),
    "dense_tied_bias": dict(TINY, tie_embeddings=True, attention_bias=True),
    "moe": dict(TINY, **MOE),
    "moe_tied_no_norm_topk": dict(TINY, **MOE, tie_embeddings=True, norm_topk_prob=False),
    # top-1 with norm_topk_prob: transformers gives the one expert weight 1 (our base MoE layer would not)
    "moe_top1": dict(TINY, **dict(MOE, top_k=1, mlp_only_layers=[]), decoder_sparse_step=2),
}


def trained_looking(config: Qwen3Config, seed: int = 0) -> Qwen3:
    """A model whose norms and biases are away from their init, so a misplaced one would show."""
    torch.manual_seed(seed)
    model = build_model(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "router" in name:
                param.normal_(0.0, 0.3)  # distinct routing probabilities: no top-k ties
    return model


def hf_class(config: Qwen3Config) -> Any:
    return transformers.Qwen3MoeForCausalLM if config.n_experts else transformers.Qwen3ForCausalLM


def hf_model(directory: Path, config: Qwen3Config) -> Any:
    model = hf_class(config).from_pretrained(str(directory), dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def hub_state(model: Any) -> dict[str, torch.Tensor]:
    """transformers' in-memory state dict in the Hub's per-expert layout, the one the adapter maps."""
    return hub_layout(model.state_dict())


def hub_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory tensors (experts fused as gate_up_proj [E, 2I, H], down_proj [E, H, I]) under
    the Hub's names (one gate/up/down projection per expert)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            prefix = name[: -len("gate_up_proj")]
            for j in range(tensor.shape[0]):
                out[f"{prefix}{j}.gate_proj.weight"], out[f"{prefix}{j}.up_proj.weight"] = gate[j], up[j]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            out.update({f"{prefix}{j}.down_proj.weight": tensor[j] for j in range(tensor.shape[0])})
        else:
            out[name] = tensor
    return out


# ---- 1. logits and training parity with transformers ----------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(tmp_path: Path, case: str) -> None:
    config = Qwen3Config(**CASES[case])
    model = trained_looking(config).eval()
    export_state_dict(model.state_dict(), config, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == [hf_class(config).__name__] and saved["head_dim"] == 32
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), hf_model(tmp_path, config)(input_ids=tokens).logits
    # measured max |difference| here: 1.5e-6 to 1.7e-6 on logits of up to 3.6 (fp32); 1e-4 leaves room for BLAS
    assert (ours - theirs).abs().max().item() < 1e-4


@pytest.mark.parametrize("case", ["dense_tied_bias", "moe", "moe_tied_no_norm_topk"])
def test_training_loss_and_gradients_equal_transformers(tmp_path: Path, case: str) -> None:
    """Our loss (cross entropy + the MoE layers' attached aux loss) equals transformers' loss with labels
    and `output_router_logits=True` (cross entropy + router_aux_loss_coef x load_balancing_loss_func, pooled
    over the MoE layers), and so does every parameter's gradient."""
    config = Qwen3Config(**CASES[case])
    model = trained_looking(config).train()
    export_state_dict(model.state_dict(), config, tmp_path)
    theirs_model = hf_model(tmp_path, config).train()
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))

    logits = model(tokens)
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    ce.backward()  # the aux loss reaches the routers through the MoE layers' _AttachAuxLoss
    out = theirs_model(input_ids=tokens, labels=tokens, output_router_logits=config.n_experts > 0)
    out.loss.backward()

    if config.n_experts:
        pooled = model.last_balance.value()
        torch.testing.assert_close(pooled, out.aux_loss, atol=1e-6, rtol=1e-6)
        ours_loss = ce + config.router_aux_loss_coef * pooled
    else:
        ours_loss = ce
    torch.testing.assert_close(ours_loss, out.loss, atol=1e-5, rtol=1e-6)
    theirs_grads = ADAPTER.from_hf(hub_layout({n: p.grad for n, p in theirs_model.named_parameters()}), config)
    ours_grads = {name: p.grad for name, p in model.named_parameters()}
    assert ours_grads.keys() <= theirs_grads.keys()
    for name, grad in ours_grads.items():
        torch.testing.assert_close(grad, theirs_grads[name], atol=2e-6, rtol=1e-4, msg=name)


def test_pooled_balance_loss_is_not_the_mean_of_per_layer_losses() -> None:
    """The pooled loss couples the layers (F_e sums every layer's counts): with two MoE layers routing
    differently it differs from the mean of the layers' own losses, which is what a per-layer
    implementation would train on. Balanced routing gives top_k."""
    config = Qwen3Config(**dict(TINY, **dict(MOE, mlp_only_layers=[])))
    model = trained_looking(config)
    model(torch.randint(0, 256, (2, 32)))
    pool = model.last_balance
    assert pool.layers == 3 and pool.counts.sum() == 3 * 64 * config.top_k
    alone = [float(m.stat_aux) for m in model.moe_layers()]
    assert abs(float(pool.value()) - sum(alone) / len(alone)) > 1e-4
    # perfectly balanced assignments and probabilities: E * sum_e (k/E) (1/E) = k
    pool.counts = torch.full((8,), 3 * 64 * 2 / 8)
    pool.prob_sums = torch.full((8,), 3 * 64 / 8)
    assert float(pool.value()) == pytest.approx(2.0)


# ---- 2. the adapter: exact round trips, init_from -----------------------------------------------------
@pytest.mark.parametrize("case", ["dense", "dense_tied_bias", "moe", "moe_tied_no_norm_topk"])
def test_export_and_import_round_trip_bitwise(tmp_path: Path, case: str) -> None:
    from safetensors.torch import load_file

    config = Qwen3Config(**CASES[case])
    state = trained_looking(config).state_dict()
    hf = ADAPTER.to_hf(state, config)
    assert ("lm_head.weight" in hf) is not config.tie_embeddings
    back = ADAPTER.from_hf(hf, config)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], v) for k, v in state.items())
    # through the files, and the names one by one
    export_state_dict(state, config, tmp_path)
    files = load_file(str(tmp_path / "model.safetensors"))
    assert files.keys() == hf.keys()
    back = ADAPTER.from_hf(files, config)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    assert read_hf_config(tmp_path) == Qwen3Config(**{**CASES[case], "name": tmp_path.name})
    for hf_name in files:
        ours, expert = ADAPTER.our_name(hf_name)
        if expert is None:
            assert ADAPTER.hf_name(ours) == hf_name
        else:
            assert ADAPTER.stacked_hf_names(ours, config.n_experts)[expert] == hf_name


def test_transformers_checkpoint_reads_into_the_same_model(tmp_path: Path) -> None:
    """A model transformers built and saved (its own init and file layout) imports to weights equal to its
    own, and its config to ours."""
    config = Qwen3Config(**CASES["moe"])
    hf_config = {k: v for k, v in ADAPTER.hf_config(config).items() if k not in ("architectures", "model_type")}
    torch.manual_seed(3)
    theirs = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**hf_config))
    theirs.save_pretrained(str(tmp_path))
    assert read_hf_config(tmp_path) == Qwen3Config(**{**CASES["moe"], "name": tmp_path.name})
    state = ADAPTER.from_hf(hub_state(theirs), config)
    model = build_model(config)
    model.load_state_dict(state)
    tokens = torch.randint(0, 256, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens), theirs.eval()(input_ids=tokens).logits, atol=1e-4, rtol=0)


# A small run: 4 steps of 8 sequences x 32 bytes, logging every step.
RUN = ["trainer.seq_len=32", "trainer.global_batch_size=8", "trainer.micro_batch_size=8", "trainer.max_steps=4",
       "trainer.log_every=1", "trainer.val_every=0", "trainer.val_batches=1", "lr_schedule.warmup_steps=1",
       "data.max_bytes=200000", "trainer.peak_flops=1e12", "trainer.num_threads=1", "callbacks=none"]


def losses(run_dir: Path, column: str = "train_loss") -> list[float]:
    with open(run_dir / "metrics.csv") as f:
        return [float(r[column]) for r in csv.DictReader(f) if r.get(column)]


@pytest.mark.parametrize("name", ["qwen3_tiny", "qwen3_moe_tiny"])
def test_a_run_continues_from_a_transformers_checkpoint_and_exports_back(tmp_path: Path, name: str) -> None:
    """init_from= a directory that transformers' save_pretrained wrote: the run starts from its weights (step
    0), its first loss is transformers' cross entropy on the first batch, it trains, and the trained model
    exports back identically from the trainer and from its checkpoint."""
    cfg = compose([f"model={name}", *RUN])
    config = model_config(cfg)
    hf_config = {k: v for k, v in ADAPTER.hf_config(config).items() if k not in ("architectures", "model_type")}
    config_class = transformers.Qwen3MoeConfig if config.n_experts else transformers.Qwen3Config
    torch.manual_seed(4)
    theirs = hf_class(config)(config_class(**hf_config)).eval()
    theirs.save_pretrained(str(tmp_path / "hf"))

    trainer = build_trainer(compose([f"model={name}", *RUN, f"init_from={tmp_path / 'hf'}"]), tmp_path / "run")
    assert trainer.step == 0
    expected_state = ADAPTER.from_hf(hub_state(theirs), config)
    for key, value in trainer.model_parts[0].state_dict().items():
        assert torch.equal(value, expected_state[key]), key
    position = trainer.train_loader.state_dict()
    ((inputs, targets),) = next(trainer.train_loader)
    trainer.train_loader.load_state_dict(position)
    with torch.no_grad():
        expected = F.cross_entropy(theirs(input_ids=inputs).logits.flatten(0, 1), targets.flatten()).item()
    trainer.fit()
    run_losses = losses(tmp_path / "run")
    assert run_losses[0] == pytest.approx(expected, rel=1e-5)
    assert run_losses[-1] < run_losses[0]

    export_trainer(trainer, tmp_path / "exported")
    checkpoint = save_checkpoint(trainer, tmp_path / "run" / "checkpoints" / "step_00000004")
    main(["export", str(checkpoint), str(tmp_path / "converted")])
    from safetensors.torch import load_file

    trained = ADAPTER.to_hf(trainer.model_parts[0].state_dict(), config)
    for directory in ("exported", "converted"):
        written = load_file(str(tmp_path / directory / "model.safetensors"))
        assert written.keys() == trained.keys()
        assert all(torch.equal(written[k], v) for k, v in trained.items())


def test_init_from_refuses_another_qwen3_shape(tmp_path: Path) -> None:
    config = Qwen3Config(**dict(TINY, head_dim=16, max_seq_len=512))
    export_state_dict(build_model(config).state_dict(), config, tmp_path / "hf")
    overrides = ["model=qwen3_tiny", "model.dim=64", "model.n_layers=3", "model.ffn_hidden_dim=96",
                 "model.n_heads=4", "model.n_kv_heads=2", "model.tie_embeddings=false", *RUN,
                 f"init_from={tmp_path / 'hf'}"]
    from trainer.checkpoint.manifest import CheckpointError

    with pytest.raises(CheckpointError, match="model.head_dim=16 vs 64"):
        build_trainer(compose(overrides), tmp_path / "run")


# ---- 3. parameter counts, FLOPs, the planner --------------------------------------------------------------
PUBLISHED = ["qwen3_0_6b", "qwen3_8b", "qwen3_30b_a3b", "qwen3_235b_a22b"]


def transformers_meta_model(config: Qwen3Config) -> Any:
    hf_config = {k: v for k, v in ADAPTER.hf_config(config).items() if k not in ("architectures", "model_type")}
    config_class = transformers.Qwen3MoeConfig if config.n_experts else transformers.Qwen3Config
    with torch.device("meta"):
        return hf_class(config)(config_class(**hf_config))


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts_equal_transformers(name: str) -> None:
    """num_params (and num_active_params: top_k of n_experts routed experts) of the real module and of the
    planner's inventory equal transformers' count of the same config, all on the meta device."""
    config = model_config(compose([f"model={name}"]))
    ours = build_meta_model(config)
    theirs = transformers_meta_model(config)
    total = sum(p.numel() for p in theirs.parameters())  # parameters() yields a tied weight once
    experts = sum(p.numel() for n, p in theirs.named_parameters() if ".mlp.experts." in n)
    active = total - experts + experts * config.top_k // config.n_experts if config.n_experts else total
    inv = inventory(config)
    assert ours.num_params() == inv.num_params() == total
    assert ours.num_active_params() == inv.num_active_params() == active
    assert ours.flops_per_token(4096) == inv.flops_per_token(4096)
    print(f"{name}: {total:,} parameters, {active:,} active")


def test_flops_per_token_equals_a_flop_count() -> None:
    """flops_per_token = 6 x (Linear weights + top_k/E of the experts) + 12 x layers x seq x n_heads x
    head_dim, against torch's FLOP counter over one forward and backward (SDPA's math path, whose matmuls
    it counts; experts one matmul each). head_dim x n_heads = 128 != dim = 64 here, and a token goes to 2 of
    8 experts: counting dim instead of the attention width, or all experts, would miss."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    for case in ("dense_tied_bias", "moe"):
        config = Qwen3Config(**dict(CASES[case], moe_grouped_mm=False))
        model = trained_looking(config)
        batch, seq = 2, 32
        tokens = torch.randint(0, 256, (batch, seq))
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(tokens).sum().backward()
        assert counter.get_total_flops() == model.flops_per_token(seq) * batch * seq, case
        # the formula by hand: matmul weights per token, attention width n_heads x head_dim
        attention = config.n_heads * config.head_dim
        kv = config.num_kv_heads * config.head_dim
        linear_per_layer = 2 * config.dim * attention + 2 * config.dim * kv
        sparse = len(config.sparse_layers)
        ffn = (config.n_layers - sparse) * 3 * config.dim * config.ffn_hidden_dim + sparse * (
            config.n_experts * config.dim + config.top_k * 3 * config.dim * config.moe_hidden_dim)
        matmul = config.n_layers * linear_per_layer + ffn + config.vocab_size * config.dim
        assert model.flops_per_token(seq) == 6 * matmul + 12 * config.n_layers * seq * attention


def test_plan_reports_the_exact_counts(capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m trainer model=qwen3_30b_a3b mode=plan`: the report's counts (JSON line: exact) are the
    model's, and exact mode (the real model on the meta device) agrees with the analytic bytes."""
    from trainer.planner.report import run

    overrides = ["model=qwen3_30b_a3b", "mode=plan", "plan.format=json"]
    cfg = compose(overrides)
    validate(cfg)
    run(cfg, overrides)
    out = capsys.readouterr().out
    data = json.loads(out.strip().splitlines()[-1])
    assert data["num_params"] == 30_532_122_624 and data["num_active_params"] == 3_353_032_704
    assert "qwen3_30b_a3b (30.532 B parameters, 3.353 B active per token)" in out
    assert data["state_bytes"]["params"] == 4 * 30_532_122_624 == data["exact"]["params"]


@pytest.mark.parametrize("policy", ["none", "full", "selective", "attention"])
def test_activation_estimate_matches_what_a_forward_saves(policy: str) -> None:
    """The planner's saved-activation model of a Llama block plus the q/k norms (activations.py, `qk_norm`)
    against the bytes a Qwen3 forward saves for the backward."""
    from hydra.utils import instantiate

    from trainer.loss import cross_entropy_loss
    from trainer.planner.activations import estimate_activations
    from trainer.plugins.activation_checkpointing.accounting import SavedActivationMeter

    cfg = compose(["model=qwen3_tiny", "trainer.micro_batch_size=4", "trainer.seq_len=128",
                   "trainer.global_batch_size=4", f"activation_checkpointing={policy}"])
    torch.manual_seed(0)
    model = build_model(model_config(cfg))
    meter = SavedActivationMeter.applying(instantiate(cfg.activation_checkpointing), model)
    with meter:
        loss = cross_entropy_loss(model(torch.randint(0, 256, (4, 128))), torch.randint(0, 256, (4, 128)))
    loss.backward()
    estimate = estimate_activations(inventory(model_config(cfg)), layout_from_config(cfg), 0, "cpu")
    assert estimate.device == pytest.approx(meter.bytes, rel=0.02)


# ---- 4. training, activation checkpointing, validation ---------------------------------------------------
@pytest.mark.parametrize("name", ["qwen3_tiny", "qwen3_moe_tiny"])
def test_the_tiny_configs_train(tmp_path: Path, name: str) -> None:
    run = [f"model={name}", "trainer.seq_len=64", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
           "trainer.max_steps=20", "trainer.log_every=1", "trainer.val_every=0", "trainer.val_batches=1",
           "lr_schedule.warmup_steps=2", "data.max_bytes=200000", "trainer.num_threads=1", "callbacks=none"]
    build_trainer(compose(run), tmp_path).fit()
    values = losses(tmp_path)
    assert len(values) == 20 and sum(values[-3:]) / 3 < values[0] - 1.0


@pytest.mark.parametrize("policy", ["full", "selective", "attention", "every_n"])
def test_activation_checkpointing_gives_the_same_gradients(policy: str) -> None:
    """Each policy wraps Qwen3's blocks (or their attention cores) and the gradients are those without it,
    the MoE's pooled aux loss included (a recompute must not count a layer's routing twice)."""
    from hydra.utils import instantiate

    config = model_config(compose(["model=qwen3_moe_tiny"]))
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(5))

    def gradients(wrap: str | None) -> dict[str, torch.Tensor]:
        model = trained_looking(config, seed=6).train()
        if wrap is not None:
            instantiate(compose([f"activation_checkpointing={wrap}"]).activation_checkpointing).apply(model)
        F.cross_entropy(model(tokens)[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
        assert model.last_balance.layers == 4
        return {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}

    plain, wrapped = gradients(None), gradients(policy)
    assert plain.keys() == wrapped.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(wrapped[name], grad, atol=1e-7, rtol=1e-6, msg=name)


PIPELINE = ["strategy=pp", "pp=2", "trainer.devices=2", "trainer.micro_batch_size=4"]


def test_validation_refuses_what_qwen3_cannot_do_yet() -> None:
    overrides = ["model=qwen3_moe_tiny", "model.mlp_only_layers=[0]"]
    with pytest.raises(ConfigError, match="trainer.preflight=false") as error:
        validate(compose(overrides))
    assert str(error.value).startswith("model.mlp_only_layers")
    # the mixed layout itself trains once the planner's memory check is off
    validate(compose([*overrides, "trainer.preflight=false"]))


@pytest.mark.parametrize("model", ["qwen3_tiny", "qwen3_moe_tiny"])
@pytest.mark.parametrize("overrides", [["strategy=tp", "tp=2", "trainer.devices=2"], PIPELINE,
                                       [*PIPELINE, "strategy.schedule=zero_bubble", "strategy.virtual_stages=2"],
                                       ["strategy=ddp", "cp=2", "trainer.devices=2"]])
def test_tensor_pipeline_and_context_parallelism_accept_qwen3(model: str, overrides: list[str]) -> None:
    """Qwen3-MoE with its pooled balance loss on (qwen3_moe_tiny: coefficient 0.01) included."""
    cfg = compose([f"model={model}", *overrides])
    assert model == "qwen3_tiny" or cfg.model.router_aux_loss_coef > 0
    validate(cfg)


@pytest.fixture
def group_of_one() -> Any:
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zero_bubble"])
def test_pipeline_stages_train_the_pooled_balance_loss_as_one_process(group_of_one: Any, schedule: str) -> None:
    """torch's looped schedules with 4 stages on one rank (the stage code of a multi-rank pipeline; adjacent
    stages hand their outputs over in memory instead of sending them): one layer per stage, layer 1 dense,
    4 micro-batches run interleaved. Each stage passes the pooled balance statistics of the layers up to its
    own on beside the hidden states and the last stage sends the whole model's back as their gradient, so
    every stage's backward (zero_bubble: split into input- and weight-gradient passes) pools over all
    three MoE layers: every gradient equals the single process's over the same micro-batches (measured:
    bitwise; with each stage's own layers only, the routers' gradients are off by up to 40% of their
    largest value and the other weights' by up to 19%), and every stage's pool ends with the whole model's
    counts. Each stage, given the others' MoE statistics rows (as the pipeline's all-reduce over pp does),
    reports the single process's `moe/*` metrics of all layers."""
    import copy
    import contextlib

    from trainer.models import family_of
    from trainer.models.moe import aux_loss_grad_scale_set
    from trainer.plugins.strategies.pipeline_schedule import SCHEDULES, PrecisionStage
    from trainer.plugins.strategies.pipeline_split import split_model, stage_layer_ranges

    config = Qwen3Config(**dict(TINY, **MOE, n_layers=4))
    assert config.sparse_layers == [0, 2, 3]
    model = trained_looking(config).train()
    reference = copy.deepcopy(model)
    micro, rows = 4, 2
    tokens = torch.randint(0, 256, (micro * rows, 16), generator=torch.Generator().manual_seed(7))
    targets = torch.randint(0, 256, (micro * rows, 16), generator=torch.Generator().manual_seed(8))

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten()) / micro

    pools = []
    with aux_loss_grad_scale_set(1.0 / micro):  # what the pipeline sets around its schedule
        for m in range(micro):
            batch = slice(m * rows, (m + 1) * rows)
            loss_fn(reference(tokens[batch]), targets[batch]).backward()
            pools.append(reference.last_balance)
        parts = split_model(model, stage_layer_ranges(4, 4), [0, 1, 2, 3])
        stages = [PrecisionStage(part, index, 4, torch.device("cpu"), group=group_of_one,
                                 autocast=contextlib.nullcontext, family=family_of(model))
                  for index, part in enumerate(parts)]
        pipeline = SCHEDULES[schedule](stages, n_microbatches=micro, loss_fn=loss_fn, scale_grads=False)
        pipeline.step(tokens, target=targets)

    grads = {name: p.grad for part in parts for name, p in part.named_parameters()}
    expected = dict(reference.named_parameters())
    assert grads.keys() == expected.keys()
    for name, param in expected.items():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-6, atol=1e-9, msg=name)
    for part in parts:  # the last micro-batch's pool on every stage: complete, after its backward
        pool = part.last_balance
        assert pool.layers == 3 and torch.equal(pool.counts, pools[-1].counts)
        if part.moe_layers():  # (the dense stage's pool has no routed tokens of its own to divide by)
            torch.testing.assert_close(pool.value(), pools[-1].value(), rtol=1e-6, atol=0)

    # the step's MoE statistics shared over the stages as if each were a rank of its own (the all-reduce over
    # pp: the sum of every stage's table): each stage then logs every layer, as the single process does
    family = family_of(model)
    tables: list[torch.Tensor] = []

    def keep(table: torch.Tensor) -> torch.Tensor:
        tables.append(table)
        return table

    for part in parts:
        family.sum_statistics_over_stages([part], keep)
    for part in parts:
        family.sum_statistics_over_stages([part], lambda table: sum(tables))
    expected_metrics, _ = family.step_statistics([reference], lambda t: t)
    assert {"moe/max_load/0", "moe/max_load/2", "moe/max_load/3"} <= expected_metrics.keys()
    for part in (parts[0], parts[1]):  # a stage holding an MoE layer, and the dense one
        metrics, loads = family.step_statistics([part], lambda t: t)
        assert metrics == pytest.approx(expected_metrics, rel=1e-12) and len(loads) == len(part.moe_layers())


def test_config_rejects_inconsistent_shapes() -> None:
    with pytest.raises(ValueError, match="even head_dim"):
        Qwen3Config(**dict(TINY, head_dim=33))
    with pytest.raises(ValueError, match="top_k=9"):
        Qwen3Config(**dict(TINY, **dict(MOE, top_k=9)))
    with pytest.raises(ValueError, match=r"mlp_only_layers \[3\]"):
        Qwen3Config(**dict(TINY, **dict(MOE, mlp_only_layers=[3])))
    assert Qwen3Config(**dict(TINY, **MOE)).sparse_layers == [0, 2]
    assert Qwen3Config(**dict(TINY, **dict(MOE, mlp_only_layers=[]), decoder_sparse_step=2)).sparse_layers == [1]
    assert isinstance(build_model(Qwen3Config(**dict(TINY, **MOE))).layers["0"].feed_forward, Qwen3MoE)


# ---- 5. data parallel against one process (2 gloo processes) --------------------------------------------
PARITY_RUN = ["trainer.seq_len=32", "trainer.global_batch_size=16", "trainer.max_steps=6", "trainer.log_every=1",
              "trainer.val_every=0", "trainer.val_batches=1", "lr_schedule.warmup_steps=2", "data.max_bytes=1000000",
              "callbacks=none", "model.n_layers=2"]


# (model, run name, strategy overrides): 2 gloo processes each
DATA_PARALLEL = [("qwen3_tiny", "ddp", ["strategy=ddp"]), ("qwen3_tiny", "zero1", ["strategy=zero1"]),
                 ("qwen3_tiny", "zero3", ["strategy=zero3"]),
                 ("qwen3_moe_tiny", "ddp", ["strategy=ddp"]), ("qwen3_moe_tiny", "zero2", ["strategy=zero2"]),
                 ("qwen3_moe_tiny", "zero3", ["strategy=zero3"]), ("qwen3_moe_tiny", "fsdp", ["strategy=fsdp"]),
                 ("qwen3_moe_tiny", "ddp_ep2", ["strategy=ddp", "ep=2"])]
# tp splits the heads with their q/k norms (sequence parallel), the MoE runs whole on each rank; pp puts one MoE
# layer on each stage under 1f1b with 4 micro-batches, the pooled balance loss spanning both (each stage passes
# the statistics of the layers up to its own on with the hidden states, the last sends the whole model's back as
# their gradient; the dense model is pipelined by the 3d run below); cp splits the sequences, the pooled loss
# summing its statistics over both halves
MODEL_PARALLEL = [("qwen3_moe_tiny", "tp2", ["strategy=tp", "tp=2"]),
                  ("qwen3_moe_tiny", "pp2", ["strategy=pp", "pp=2"]),
                  ("qwen3_moe_tiny", "cp2", ["strategy=ddp", "cp=2"])]
PARITY_RUNS = [*DATA_PARALLEL, *MODEL_PARALLEL]
# 4 processes: Qwen3 over tp x pp (3d), Qwen3-MoE over tp x ep x dp (zero3; each data-parallel rank's 2 micro-batches
# are 2 of the single process's 4)
THREE_D = [("qwen3_tiny", "3d_tp2_pp2", ["strategy=3d", "tp=2", "pp=2"]),
           ("qwen3_moe_tiny", "3d_tp2_ep2_zero3", ["strategy=3d", "tp=2", "ep=2", "strategy.data_parallel=zero3"])]


POOL.add("qwen3", 2, [
    {"name": f"{model}_{name}",
     "overrides": [f"model={model}", *PARITY_RUN, *overrides, "trainer.devices=2", "trainer.micro_batch_size=4"]}
    for model, name, overrides in PARITY_RUNS])
POOL.add("qwen3", 4, [
    {"name": f"{model}_{name}",
     "overrides": [f"model={model}", *PARITY_RUN, *overrides, "trainer.devices=4", "trainer.micro_batch_size=4"]}
    for model, name, overrides in THREE_D])


# What rank 0 logs of the MoE layers (under pp both stages' layers: the family sums the rows over the stages).
MOE_METRICS = ("moe/aux_loss", "moe/z_loss", "moe/max_load", "moe/max_load/0", "moe/max_load/1", "moe/dropped")


@pytest.mark.slow
def test_every_strategy_matches_one_process(tmp_path: Path) -> None:
    """2 ranks x 2 micro-batches of 4 hold the same micro-batches as one process's 4 micro-batches of 4, so
    the per-micro-batch pooled aux loss is the same too: same losses and weights (ep=2: each rank holds 4
    of the 8 experts of every layer and exchanges tokens). tp, pp and cp run all 4 micro-batches on both
    ranks: the parity rule's rtol 1e-4 for model parallelism, and weights within 1e-4 as the other
    model-parallel tests (Adam's normalized steps turn tiny gradient differences of near-zero gradients into
    weight differences of a fraction of the LR). On 4 processes, 3d tp2 x pp2 and tp2 x ep2 x zero3 alike.
    Gradient norms and, for Qwen3-MoE, what rank 0 logs of the MoE layers (`MOE_METRICS`: under pp2 one layer
    per stage, the rows shared over the stages) within the same tolerances as the losses.
    Measured over 6 steps: losses at most 1.3e-7 relative apart (every layout), Qwen3-MoE's gradient norms
    5.2e-7 (pp2 1.0e-7, 3d 7.0e-7) and moe/* 1.5e-7 (pp2 2.9e-8), weights 1.3e-6 (data parallel, ep2 the
    farthest), 8.2e-6 (tp2; cp2 6.5e-6, pp2 3.7e-7) and 6.7e-5 (3d tp2 x pp2). Without the pooled statistics
    passed between the stages, the pp2 losses are up to 7.6e-4 apart (3 of the 6 fail); without
    the rows shared over the stages, rank 0 logs moe/aux_loss of its own layer, 6.8% off."""
    launched = {2: POOL.ensure(2, "qwen3") / "np2", 4: POOL.ensure(4, "qwen3") / "np4"}
    runs = [(2, *run) for run in PARITY_RUNS] + [(4, *run) for run in THREE_D]
    for model in ("qwen3_tiny", "qwen3_moe_tiny"):
        reference = build_trainer(compose([f"model={model}", *PARITY_RUN, "trainer.micro_batch_size=4"]),
                                  tmp_path / model)
        reference.fit()
        weights = reference.strategy.full_state_dict(reference.model_parts)
        for world, name in ((world, name) for world, m, name, _ in runs if m == model):
            run_dir = launched[world] / f"{model}_{name}"
            rel = 1e-4 if world == 4 or any(name == n for _, n, _ in MODEL_PARALLEL) else 1e-5
            for metric in ("train_loss", "grad_norm", *(MOE_METRICS if model == "qwen3_moe_tiny" else ())):
                expected = losses(tmp_path / model, metric)
                assert len(expected) == 6 and losses(run_dir, metric) == pytest.approx(expected, rel=rel), \
                    (model, name, metric)
            theirs = torch.load(run_dir / "weights.pt", weights_only=True)
            assert theirs.keys() == weights.keys()
            for key, value in weights.items():
                torch.testing.assert_close(theirs[key], value, atol=1e-4 if rel == 1e-4 else 1e-5, rtol=0,
                                           msg=f"{model} {name} {key}")
