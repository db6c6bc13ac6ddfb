"""Tests for trainer.optim: weight-decay grouping and optimizer construction."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from trainer.optim import (
    build_optimizer,
    optimizer_from_config,
    param_groups,
)
from trainer.plugins.optimizers import AdamWConfig, SGDConfig

CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "optimizer"
SCHEMAS: dict[str, type] = {"adamw": AdamWConfig, "sgd": SGDConfig}


class TinyLM(nn.Module):
    """Covers every grouping rule: embeddings, Linear, norms, a raw scale, tied head."""

    def __init__(self, vocab: int = 11, dim: int = 8, context: int = 5) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)
        self.gate = nn.Parameter(torch.ones(dim))  # custom 1-D parameter
        self.norm2 = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        x = x + self.gate * self.proj(self.norm1(x))
        return self.head(self.norm2(x))


def by_name(groups: list[dict[str, Any]]) -> dict[str, list[nn.Parameter]]:
    return {group["name"]: group["params"] for group in groups}


def ids(params: list[nn.Parameter]) -> list[int]:
    return [id(p) for p in params]


def load_config(name: str, overrides: dict[str, Any] | None = None) -> DictConfig:
    """Mimic Hydra's defaults list: schema first, then the yaml, then overrides."""
    raw = OmegaConf.load(CONF_DIR / f"{name}.yaml")
    assert list(raw.pop("defaults")) == [f"{name}_schema", "_self_"]
    return OmegaConf.merge(OmegaConf.structured(SCHEMAS[name]), raw, overrides or {})


# ---------------------------------------------------------------------------
# param_groups
# ---------------------------------------------------------------------------


def test_grouping_rules_and_order() -> None:
    model = TinyLM()
    groups = param_groups([model], weight_decay=0.1)

    assert [g["name"] for g in groups] == ["decay", "no_decay"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    named = by_name(groups)
    assert ids(named["decay"]) == ids([model.proj.weight])
    # Module traversal order; the tied head weight is the token table, listed once.
    assert ids(named["no_decay"]) == ids(
        [
            model.gate,
            model.tok.weight,
            model.pos.weight,
            model.norm1.weight,
            model.norm1.bias,
            model.proj.bias,
            model.norm2.weight,
        ]
    )


def test_every_trainable_parameter_appears_exactly_once() -> None:
    model = TinyLM()
    grouped = [p for g in param_groups([model], 0.1) for p in g["params"]]
    assert len(grouped) == len(set(ids(grouped)))
    assert set(ids(grouped)) == set(ids(list(model.parameters())))


def test_tied_head_registered_before_embedding_still_not_decayed() -> None:
    # The Linear owner is met first; the later Embedding owner must still win.
    head = nn.Linear(4, 6, bias=False)
    emb = nn.Embedding(6, 4)
    head.weight = emb.weight
    model = nn.Sequential(head, emb)
    assert [g["name"] for g in param_groups([model], 0.1)] == ["no_decay"]


def test_parameter_shared_between_modules_appears_once() -> None:
    emb = nn.Embedding(6, 4)
    head = nn.Linear(4, 6)
    head.weight = emb.weight
    named = by_name(param_groups([emb, head, emb], weight_decay=0.1))
    assert "decay" not in named
    assert ids(named["no_decay"]) == ids([emb.weight, head.bias])


def test_empty_groups_are_dropped() -> None:
    assert [g["name"] for g in param_groups([nn.LayerNorm(4)], 0.1)] == ["no_decay"]
    assert [g["name"] for g in param_groups([nn.Linear(3, 3, bias=False)], 0.1)] == ["decay"]
    assert param_groups([nn.ReLU()], 0.1) == []


def test_frozen_parameters_are_left_out() -> None:
    model = TinyLM()
    model.pos.weight.requires_grad_(False)
    grouped = [p for g in param_groups([model], 0.1) for p in g["params"]]
    assert id(model.pos.weight) not in ids(grouped)


def test_other_matrix_weights_are_decayed() -> None:
    conv = nn.Conv1d(2, 3, kernel_size=3)
    named = by_name(param_groups([conv], 0.1))
    assert ids(named["decay"]) == ids([conv.weight])
    assert ids(named["no_decay"]) == ids([conv.bias])


@pytest.mark.parametrize("weight_decay", [-0.1, float("nan")])
def test_invalid_weight_decay_raises(weight_decay: float) -> None:
    with pytest.raises(ValueError, match="weight_decay must be >= 0"):
        param_groups([nn.Linear(2, 2)], weight_decay)


# ---------------------------------------------------------------------------
# build_optimizer
# ---------------------------------------------------------------------------


def test_build_optimizer_keeps_group_names_and_decay() -> None:
    model = TinyLM()
    optimizer = build_optimizer(functools.partial(torch.optim.AdamW, lr=1e-3), [model], 0.05)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert [(g["name"], g["weight_decay"]) for g in optimizer.param_groups] == [
        ("decay", 0.05),
        ("no_decay", 0.0),
    ]


def test_build_optimizer_rejects_weight_decay_in_factory() -> None:
    factory = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    with pytest.raises(ValueError, match="must not set weight_decay"):
        build_optimizer(factory, [nn.Linear(2, 2)], 0.1)


def test_build_optimizer_without_parameters_raises() -> None:
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(torch.optim.SGD, [nn.ReLU()], 0.0)


# ---------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------


def test_adamw_from_yaml_has_configured_hyperparameters() -> None:
    cfg = load_config("adamw")
    optimizer = optimizer_from_config(cfg, [TinyLM()])

    assert type(optimizer) is torch.optim.AdamW
    for group in optimizer.param_groups:
        assert group["lr"] == pytest.approx(3.0e-3)
        assert tuple(group["betas"]) == pytest.approx((0.9, 0.95))
        assert group["eps"] == pytest.approx(1.0e-8)
        assert group["fused"] is True  # fused: null -> torch's fused kernel, which runs on CPU tensors
        assert group["foreach"] is None
    assert [(g["name"], g["weight_decay"]) for g in optimizer.param_groups] == [
        ("decay", pytest.approx(0.1)),
        ("no_decay", 0.0),
    ]
    assert len(optimizer.param_groups[0]["params"]) == 1
    assert len(optimizer.param_groups[1]["params"]) == 7
    # The caller's config is left untouched.
    assert cfg.weight_decay == pytest.approx(0.1)


def test_adamw_step_with_zero_grads_is_pure_decoupled_decay() -> None:
    lr, weight_decay = 0.5, 0.2
    model = TinyLM()
    cfg = load_config("adamw", {"lr": lr, "weight_decay": weight_decay})
    optimizer = optimizer_from_config(cfg, [model])
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # zero, not None: the step must visit every parameter
    optimizer.step()

    # With zero gradients Adam's moments stay zero, leaving only p *= 1 - lr * wd.
    torch.testing.assert_close(model.proj.weight, before["proj.weight"] * (1 - lr * weight_decay))
    for name, p in model.named_parameters():
        if name != "proj.weight":
            torch.testing.assert_close(p, before[name], rtol=0, atol=0)


def test_sgd_from_yaml_trains() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    cfg = load_config("sgd")
    optimizer = optimizer_from_config(cfg, [model])

    assert type(optimizer) is torch.optim.SGD
    for group in optimizer.param_groups:
        assert (group["lr"], group["momentum"], group["nesterov"]) == (0.1, 0.9, False)
        assert group["weight_decay"] == 0.0

    idx = torch.randint(0, 11, (4, 5))
    losses = []
    for _ in range(5):
        logits = model(idx[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 11), idx[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_sgd_weight_decay_reaches_only_decay_group() -> None:
    model = TinyLM()
    optimizer = optimizer_from_config(load_config("sgd", {"weight_decay": 0.01}), [model])
    assert [(g["name"], g["weight_decay"]) for g in optimizer.param_groups] == [
        ("decay", pytest.approx(0.01)),
        ("no_decay", 0.0),
    ]


def test_optimizer_from_plain_config_without_weight_decay() -> None:
    cfg = OmegaConf.create({"_target_": "torch.optim.SGD", "lr": 0.01})
    optimizer = optimizer_from_config(cfg, [nn.Linear(2, 2)])
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.0, 0.0]


def test_schema_rejects_unknown_option() -> None:
    with pytest.raises(Exception, match="betaz"):
        load_config("adamw", {"betaz": [0.9, 0.99]})


def test_fused_kernel_only_where_it_runs_and_not_against_the_users_choice() -> None:
    """fused: null picks the fused AdamW for plain CPU tensors and DTensor-free models; meta tensors (the
    planner's exact mode) and an explicit foreach or fused=false keep torch's own implementations."""
    def fused(overrides: dict, model: nn.Module) -> object:
        return optimizer_from_config(load_config("adamw", overrides), [model]).param_groups[0]["fused"]

    assert fused({}, TinyLM()) is True
    assert fused({}, TinyLM().to("meta")) is None
    assert fused({"foreach": True}, TinyLM()) is None
    assert fused({"fused": False}, TinyLM()) is False
    # the fused step is the same AdamW: equal to torch's per-tensor loop within rounding
    models = [TinyLM(), TinyLM()]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [optimizer_from_config(load_config("adamw", {}), [models[0]]),
                  optimizer_from_config(load_config("adamw", {"fused": False}), [models[1]])]
    for _ in range(3):
        for model, optimizer in zip(models, optimizers, strict=True):
            for p in model.parameters():
                p.grad = torch.ones_like(p) * 0.1 + p.detach()
            optimizer.step()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("target, options, states", [
    ("torch.optim.AdamW", {"betas": [0.9, 0.95]}, 2),  # exp_avg, exp_avg_sq
    ("torch.optim.AdamW", {"amsgrad": True}, 3),  # + max_exp_avg_sq
    ("torch.optim.SGD", {"momentum": 0.9}, 1),
    ("torch.optim.SGD", {"momentum": 0.0}, 0),
    ("torch.optim.Adagrad", {}, 1),  # `sum`: its name says nothing of it
])
def test_the_planner_counts_an_optimizers_states_from_the_optimizer_not_its_name(
        target: str, options: dict, states: int) -> None:
    from trainer.optim import optimizer_state_tensors

    cfg = OmegaConf.create({"_target_": target, "_partial_": True, "lr": 0.01, "weight_decay": 0.1, **options})
    assert optimizer_state_tensors(cfg) == states


@pytest.mark.parametrize("options, folded", [({}, True), ({"fused": False}, False)])
def test_a_fused_optimizer_clips_inside_its_step(options: dict, folded: bool) -> None:
    """The strategy's clip goes to torch's fused kernel as `grad_scale` (the gradients are left as they are,
    the step divides them by it) and gives the parameters of torch's `clip_grad_norm_` then the step
    (measured: at most 1.0e-7 relative, 4.7e-10 absolute; 10x margin); with another kernel the gradients are clipped
    in place. `zero_grad` clears the factor: a later step without a clip is not scaled by it."""
    from trainer.interfaces.strategy import Strategy

    torch.manual_seed(0)
    models = [TinyLM(), TinyLM()]
    models[1].load_state_dict(models[0].state_dict())
    strategy = Strategy()
    optimizer = strategy.build_optimizer(load_config("adamw", options), [models[0]])
    reference = optimizer_from_config(load_config("adamw", options), [models[1]])
    for step in range(3):
        grads = [torch.randn_like(p) * (step + 1) for p in models[0].parameters()]
        for model in models:
            for p, grad in zip(model.parameters(), grads, strict=True):
                p.grad = grad.clone()
        max_norm = 0.5 if step < 2 else 0.0  # the last step: no clip
        norm = strategy.clip_grad_norm([models[0]], max_norm)
        expected = torch.nn.utils.clip_grad_norm_(models[1].parameters(), max_norm) if max_norm else norm
        torch.testing.assert_close(norm, expected, rtol=0, atol=0)
        assert norm > 1.0
        scale = getattr(optimizer, "grad_scale", None)
        if max_norm and folded:
            assert scale is not None and float(scale) == pytest.approx(float(norm) / max_norm, rel=1e-5)
            assert all(torch.equal(p.grad, grad) for p, grad in zip(models[0].parameters(), grads, strict=True))
        else:
            assert scale is None
        assert strategy.optimizer_step(optimizer)
        reference.step()
        strategy.zero_grad([models[0]], optimizer)
        reference.zero_grad()
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
