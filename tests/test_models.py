"""Tests of trainer.models: shapes, exact sizes of the published configs, init, FLOPs."""

from __future__ import annotations

import copy
import dataclasses
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from trainer.models import SCHEMAS as MODEL_SCHEMAS
from trainer.models import GPT, GPTConfig, Llama, LlamaConfig, build_meta_model, build_model
from trainer.models.llama import apply_rope, compute_rope_cache

MODEL_CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "model"
# Every family's schema, as trainer.config.register_configs stores them (`<family>_schema`).
SCHEMAS: dict[str, type] = {f"{name}_schema": schema for name, schema in MODEL_SCHEMAS.items()}


def load_config(name: str) -> Any:
    """Load conf/model/<name>.yaml onto the dataclass its defaults list names."""
    raw = OmegaConf.load(MODEL_CONF_DIR / f"{name}.yaml")
    defaults = raw.pop("defaults")
    (schema_name,) = [entry for entry in defaults if entry in SCHEMAS]
    merged = OmegaConf.merge(OmegaConf.structured(SCHEMAS[schema_name]), raw)
    return OmegaConf.to_object(merged)


def small_gpt_config(**overrides: Any) -> GPTConfig:
    base = dict(name="gpt_test", vocab_size=96, max_seq_len=32, dim=64, n_layers=2, n_heads=4)
    base.update(overrides)
    return GPTConfig(**base)


def seeded_build(config: Any, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(config).eval()


@pytest.fixture(scope="module")
def tiny_config() -> LlamaConfig:
    return load_config("tiny")


@pytest.fixture(scope="module")
def tiny_model(tiny_config: LlamaConfig) -> Llama:
    return seeded_build(tiny_config)


# --------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    "name, expected",
    [
        ("llama2_7b", 6_738_415_616),
        ("llama2_13b", 13_015_864_320),
        ("llama2_70b", 68_976_648_192),
        ("llama3_8b", 8_030_261_248),
        ("llama3_70b", 70_553_706_496),
        ("llama3_405b", 405_853_388_800),
        ("gpt2_small", 124_439_808),
    ],
)
def test_published_param_counts(name: str, expected: int) -> None:
    assert build_meta_model(load_config(name)).num_params() == expected


def test_gpt3_175b_param_count_matches_closed_form() -> None:
    cfg = load_config("gpt3_175b")
    h, layers, vocab, positions = cfg.dim, cfg.n_layers, cfg.vocab_size, cfg.max_seq_len
    # Per layer: qkv 3h^2+3h, wo h^2+h, w1 4h^2+4h, w2 4h^2+h, two LayerNorms 4h;
    # plus tied token table, learned positions and the final LayerNorm.
    closed_form = vocab * h + positions * h + layers * (12 * h * h + 13 * h) + 2 * h
    count = build_meta_model(cfg).num_params()
    assert count == closed_form
    assert 174.5e9 <= count <= 175.5e9


@pytest.mark.parametrize("path", sorted(MODEL_CONF_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_model_yaml_loads_and_composes(path: Path) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    cfg = load_config(path.stem)
    assert cfg.name == path.stem
    store = ConfigStore.instance()
    for schema_name, schema in SCHEMAS.items():
        store.store(group="model", name=schema_name, node=schema)
    with initialize_config_dir(config_dir=str(MODEL_CONF_DIR.parent), version_base="1.3"):
        composed = compose(overrides=[f"+model={path.stem}"])
    assert OmegaConf.to_object(composed.model) == cfg


@pytest.mark.parametrize("name", ["llama2_7b", "llama2_13b", "llama2_70b", "llama3_8b",
                                  "llama3_70b", "llama3_405b", "tiny"])
def test_llama_yaml_sets_ffn_explicitly_and_meta_rule_agrees(name: str) -> None:
    raw = OmegaConf.load(MODEL_CONF_DIR / f"{name}.yaml")
    assert raw.ffn_hidden_dim is not None
    if name != "tiny":  # tiny's width is chosen freely, not by Meta's rule
        cfg = load_config(name)
        assert dataclasses.replace(cfg, ffn_hidden_dim=None).hidden_dim == cfg.ffn_hidden_dim


def test_invalid_configs_raise_value_error() -> None:
    with pytest.raises(ValueError, match="dim must be divisible by n_heads"):
        LlamaConfig(dim=100, n_heads=8)
    with pytest.raises(ValueError, match="n_heads must be divisible by n_kv_heads"):
        LlamaConfig(dim=256, n_heads=8, n_kv_heads=3)
    with pytest.raises(ValueError, match="dim must be divisible by n_heads"):
        GPTConfig(dim=100, n_heads=12)
    with pytest.raises(ValueError, match="attn_impl"):
        GPTConfig(attn_impl="flash")
    # Configs mutated after construction are re-checked by the model.
    cfg = small_gpt_config()
    cfg.attn_impl = "nope"
    with pytest.raises(ValueError, match="attn_impl"):
        build_meta_model(cfg)


# --------------------------------------------------------------------------- build / init


@pytest.mark.parametrize("name", ["llama3_405b", "gpt3_175b"])
def test_meta_build_allocates_nothing(name: str) -> None:
    model = build_meta_model(load_config(name))
    tensors = list(model.parameters()) + list(model.buffers())
    assert tensors and all(t.is_meta for t in tensors)


def test_tiny_forward_shape_and_finite(tiny_model: Llama, tiny_config: LlamaConfig) -> None:
    tokens = torch.randint(0, tiny_config.vocab_size, (2, 24))
    logits = tiny_model(tokens)
    assert logits.shape == (2, 24, tiny_config.vocab_size)
    assert torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="max_seq_len"):
        tiny_model(torch.zeros(1, tiny_config.max_seq_len + 1, dtype=torch.long))


@pytest.mark.parametrize("config_fn", [lambda: load_config("tiny"), small_gpt_config])
def test_init_is_deterministic_under_seed(config_fn: Any) -> None:
    first, second = seeded_build(config_fn(), 0), seeded_build(config_fn(), 0)
    other = seeded_build(config_fn(), 1)
    for (name, a), (_, b), (_, c) in zip(
        first.state_dict().items(), second.state_dict().items(), other.state_dict().items()
    ):
        assert torch.equal(a, b), name
        if a.numel() > 1 and a.std() > 0:
            assert not torch.equal(a, c), name


def test_init_values(tiny_model: Llama, tiny_config: LlamaConfig) -> None:
    cfg = tiny_config
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    block = tiny_model.layers["0"]
    assert torch.equal(block.attention_norm.weight, torch.ones(cfg.dim))
    assert torch.equal(tiny_model.norm.weight, torch.ones(cfg.dim))
    assert block.attention.wq.weight.std().item() == pytest.approx(cfg.init_std, rel=0.05)
    assert block.attention.wo.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert block.feed_forward.w2.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    # to_empty left garbage in the non-persistent RoPE buffer; init_weights rebuilt it.
    expected = compute_rope_cache(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
    assert torch.equal(tiny_model.rope_cache, expected)
    assert "rope_cache" not in tiny_model.state_dict()


def test_rope_cache_stays_fp32_when_model_is_cast(tiny_config: LlamaConfig) -> None:
    model = seeded_build(tiny_config).to(torch.bfloat16)
    assert model.tok_embeddings.weight.dtype == torch.bfloat16
    expected = compute_rope_cache(tiny_config.head_dim, tiny_config.max_seq_len, 1e4)
    assert torch.equal(model.rope_cache, expected)
    assert model(torch.zeros(1, 4, dtype=torch.long)).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "config", [small_gpt_config(), dataclasses.replace(LlamaConfig(), vocab_size=96, dim=64,
                                                       n_layers=2, n_heads=4, tie_embeddings=True)],
    ids=["gpt", "llama"],
)
def test_tied_embeddings_share_storage_and_count_once(config: Any) -> None:
    model = seeded_build(config)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    untied = build_meta_model(dataclasses.replace(config, tie_embeddings=False))
    table = config.vocab_size * config.dim
    assert model.num_params() == untied.num_params() - table
    # Tied: the head is the embedding table, so dropping embeddings drops it too.
    assert model.num_params(exclude_embeddings=True) == untied.num_params(
        exclude_embeddings=True
    ) - table


def test_num_params_exclude_embeddings() -> None:
    llama = build_meta_model(LlamaConfig())
    assert llama.num_params() - llama.num_params(exclude_embeddings=True) == 32000 * 4096
    gpt = build_meta_model(GPTConfig())
    assert gpt.num_params() - gpt.num_params(exclude_embeddings=True) == (50257 + 1024) * 768


def test_build_model_accepts_structured_dictconfig(tiny_config: LlamaConfig) -> None:
    model = build_model(OmegaConf.structured(tiny_config))
    assert isinstance(model, Llama)
    assert isinstance(build_meta_model(small_gpt_config()), GPT)
    with pytest.raises(TypeError):
        build_model({"_target_": "trainer.models.llama.Llama"})  # type: ignore[arg-type]


# --------------------------------------------------------------------------- attention


def test_rope_is_hf_rotate_half(tiny_config: LlamaConfig) -> None:
    cfg = tiny_config
    seq_len, half = 10, cfg.head_dim // 2
    cache = compute_rope_cache(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)[:seq_len]
    x = torch.randn(1, seq_len, 2, cfg.head_dim)
    # Frequency i rotates channel pair (i, i + D/2) by pos * theta^(-2i/D).
    inv_freq = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / cfg.head_dim)
    angle = (torch.arange(seq_len, dtype=torch.float64)[:, None] * inv_freq)[None, :, None, :]
    lo, hi = x[..., :half].double(), x[..., half:].double()
    expected = torch.cat(
        (lo * angle.cos() - hi * angle.sin(), hi * angle.cos() + lo * angle.sin()), dim=-1
    )
    torch.testing.assert_close(apply_rope(x, cache).double(), expected, atol=1e-5, rtol=0)


def test_gqa_matches_repeat_interleave_reference(tiny_model: Llama) -> None:
    attn = tiny_model.layers["1"].attention
    assert attn.n_kv_heads < attn.n_heads
    batch, seq_len, dim = 2, 12, tiny_model.config.dim
    heads, kv_heads, head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
    x = torch.randn(batch, seq_len, dim)
    rope = tiny_model.rope_cache[:seq_len]
    q = apply_rope(attn.wq(x).view(batch, seq_len, heads, head_dim), rope).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(batch, seq_len, kv_heads, head_dim), rope).transpose(1, 2)
    v = attn.wv(x).view(batch, seq_len, kv_heads, head_dim).transpose(1, 2)
    # Query head j reads kv head j // (heads / kv_heads), as in HF's repeat_kv.
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
    future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    expected = attn.wo((probs @ v).transpose(1, 2).reshape(batch, seq_len, dim))
    torch.testing.assert_close(attn(x, rope), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "config_fn",
    [lambda: load_config("tiny"), lambda: small_gpt_config(attn_impl="sdpa"),
     lambda: small_gpt_config(attn_impl="materialized")],
    ids=["llama", "gpt-sdpa", "gpt-materialized"],
)
def test_causal(config_fn: Any) -> None:
    config = config_fn()
    model = seeded_build(config)
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    t = 7
    changed = tokens.clone()
    changed[:, t + 1] = (changed[:, t + 1] + 1) % config.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, : t + 1], after[:, : t + 1], atol=1e-6, rtol=0)
    assert not torch.allclose(before[:, t + 1], after[:, t + 1])


def test_materialized_attention_matches_sdpa() -> None:
    sdpa = seeded_build(small_gpt_config(attn_impl="sdpa"))
    materialized = seeded_build(small_gpt_config(attn_impl="materialized"))
    tokens = torch.randint(0, 96, (3, 32))
    sdpa.train(), materialized.train()  # dropout is 0, so train mode is deterministic
    torch.testing.assert_close(materialized(tokens), sdpa(tokens), atol=1e-5, rtol=0)


def test_materialized_attention_dropout_is_active_in_train_mode() -> None:
    model = seeded_build(small_gpt_config(attn_impl="materialized", dropout=0.5)).train()
    tokens = torch.randint(0, 96, (1, 8))
    assert not torch.equal(model(tokens), model(tokens))
    model.eval()
    assert torch.equal(model(tokens), model(tokens))


# --------------------------------------------------------------------------- pipeline / wrappers


def split_two_stages(model: nn.Module, boundary: int) -> tuple[nn.Module, nn.Module]:
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    for name in model.last_stage_modules:
        setattr(first, name, None)
    for name in model.first_stage_modules:
        setattr(second, name, None)
    for key in list(model.layers.keys()):
        del (second if int(key) < boundary else first).layers[key]
    return first, second


@pytest.mark.parametrize(
    "config_fn", [lambda: load_config("tiny"), small_gpt_config], ids=["llama", "gpt"]
)
def test_pipeline_stages_reproduce_full_model(config_fn: Any) -> None:
    config = config_fn()
    model = seeded_build(config)
    first, second = split_two_stages(model, boundary=1)
    assert list(second.layers.keys()) == [str(i) for i in range(1, config.n_layers)]
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 16, config.dim)
        torch.testing.assert_close(second(hidden), model(tokens), atol=0, rtol=0)
    # Stage FLOPs add up to the whole model's (the tied head is a matmul on the last stage).
    assert first.flops_per_token(16) + second.flops_per_token(16) == model.flops_per_token(16)
    # A stage materialized from meta initializes just what it owns.
    meta_first, _ = split_two_stages(build_meta_model(config), boundary=1)
    meta_first.to_empty(device="cpu")
    meta_first.init_weights()
    assert all(not p.is_meta for p in meta_first.parameters())


def test_gpt_stage_without_tokens_must_drop_positions() -> None:
    model = seeded_build(small_gpt_config())
    model.tok_embeddings = None
    with pytest.raises(ValueError, match="pos_embeddings"):
        model(torch.randn(1, 4, 64))


def test_blocks_work_under_activation_checkpointing(tiny_model: Llama) -> None:
    from torch.utils.checkpoint import checkpoint

    block = tiny_model.layers["0"]
    rope = tiny_model.rope_cache[:8]
    x = torch.randn(2, 8, tiny_model.config.dim, requires_grad=True)
    (grad_plain,) = torch.autograd.grad(block(x, rope).sum(), x)
    out = checkpoint(block, x, rope, use_reentrant=False)
    (grad_ckpt,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(grad_ckpt, grad_plain)


# --------------------------------------------------------------------------- FLOPs


@pytest.mark.parametrize("bias", [False, True])
def test_flops_per_token_is_narayanan_formula_for_gpt3(bias: bool) -> None:
    cfg = dataclasses.replace(load_config("gpt3_175b"), bias=bias)
    model = build_meta_model(cfg)
    l, h, vocab = cfg.n_layers, cfg.dim, cfg.vocab_size
    # Matmul weights: 12h^2 per layer (qkv 3h^2, wo h^2, MLP 8h^2) plus the tied head.
    assert model.num_matmul_params() == 12 * l * h * h + vocab * h
    for seq_len in (cfg.max_seq_len, 1000):
        s = seq_len
        narayanan = 72 * l * h * h * (1 + Fraction(s, 6 * h) + Fraction(vocab, 12 * l * h))
        assert model.flops_per_token(seq_len) == narayanan
        assert model.flops_per_token(seq_len) == 6 * model.num_matmul_params() + 12 * l * s * h
    # Position embeddings, norms and biases are all that is left out (the tied token table
    # is counted once in num_params and once as the head in num_matmul_params).
    norms_and_biases = l * 13 * h + 2 * h if bias else (2 * l + 1) * h
    non_matmul = model.num_params() - model.num_matmul_params()
    assert non_matmul == cfg.max_seq_len * h + norms_and_biases


def test_llama_flops_counts_gqa_projections_and_untied_head() -> None:
    cfg = load_config("llama3_8b")
    model = build_meta_model(cfg)
    kv_dim = cfg.num_kv_heads * cfg.head_dim
    per_layer = 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv_dim + 3 * cfg.dim * cfg.hidden_dim
    matmul = cfg.n_layers * per_layer + cfg.vocab_size * cfg.dim
    assert model.num_matmul_params() == matmul
    assert model.flops_per_token(8192) == 6 * matmul + 12 * cfg.n_layers * 8192 * cfg.dim


def test_flops_per_token_matches_flop_counter(tiny_model: Llama) -> None:
    batch, seq_len = 2, 64
    tokens = torch.randint(0, tiny_model.config.vocab_size, (batch, seq_len))
    expected = batch * seq_len * tiny_model.flops_per_token(seq_len)
    attention = batch * seq_len * 12 * tiny_model.config.n_layers * seq_len * tiny_model.config.dim

    def counted() -> int:
        with FlopCounterMode(display=False) as counter:
            tiny_model(tokens).sum().backward()
        tiny_model.zero_grad(set_to_none=True)
        return counter.get_total_flops()

    # What FlopCounterMode does with causal SDPA (torch 2.13): the formula it registers
    # for the flash / efficient / cuDNN kernels takes no is_causal argument and counts
    # QK^T and PV in full (see test_sdpa_flop_formula_ignores_causality). The CPU flash
    # kernel, which SDPA picks here by default, has no formula at all, so its attention is
    # counted as 0. Forcing the math backend decomposes SDPA into bmm's over the full
    # S x S score matrix (masked, not skipped), which are counted in full as well.
    default_count = counted()
    assert default_count in (expected - attention, expected)
    with sdpa_kernel(SDPBackend.MATH):
        math_count = counted()
    assert math_count == pytest.approx(expected, rel=0.02)


def test_sdpa_flop_formula_ignores_causality() -> None:
    from torch.utils import flop_counter

    formula = getattr(flop_counter, "sdpa_flop_count", None)
    if formula is None:
        pytest.skip("torch no longer exposes sdpa_flop_count")
    b, heads, kv_heads, s, d = 2, 8, 4, 64, 32
    # Full, non-causal cost (2*s*s*d per head for each of QK^T and PV), GQA heads broadcast.
    full = 2 * (2 * b * heads * s * s * d)
    assert formula((b, heads, s, d), (b, kv_heads, s, d), (b, kv_heads, s, d)) == full


# ---- random streams for tensor-parallel dropout ---------------------------------------------------------
def _mask(stream: int) -> torch.Tensor:
    from trainer.models.common import StreamDropout

    dropout = StreamDropout(0.5)
    dropout.rng_stream = stream
    return dropout(torch.ones(64)) == 0


def test_rng_stream_0_is_the_shared_generator_and_others_differ_but_advance_it_alike() -> None:
    torch.manual_seed(3)
    plain = F.dropout(torch.ones(64), 0.5) == 0
    torch.manual_seed(3)
    assert torch.equal(_mask(0), plain)
    masks, states = {}, {}
    for stream in (1, 2):
        torch.manual_seed(3)
        masks[stream] = _mask(stream)
        states[stream] = torch.get_rng_state()
    assert not torch.equal(masks[1], masks[2])
    assert not torch.equal(masks[1], plain) and not torch.equal(masks[2], plain)
    # every tp rank leaves the shared generator in the same state, whatever its stream
    assert torch.equal(states[1], states[2])
    torch.manual_seed(3)
    assert torch.equal(_mask(1), masks[1])


@pytest.mark.parametrize("attn_impl", ["materialized", "sdpa"])
def test_a_recompute_replays_the_dropout_of_a_rank_stream(attn_impl: str) -> None:
    """Activation checkpointing restores the shared generator before recomputing: the per-rank stream's seed
    is drawn from it, so the recomputed mask (and so every gradient) is the one of the forward."""
    from torch.utils.checkpoint import checkpoint

    config = GPTConfig(vocab_size=64, max_seq_len=16, dim=32, n_layers=1, n_heads=2, dropout=0.3, attn_impl=attn_impl)
    torch.manual_seed(0)
    block = GPT(config).layers["0"]
    for module in block.modules():
        if hasattr(module, "rng_stream"):
            module.rng_stream = 2
    x = torch.randn(2, 16, 32)
    grads = []
    for recompute in (False, True):
        torch.manual_seed(1)
        out = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        grads.append(torch.autograd.grad(out.square().sum(), list(block.parameters())))
    for plain, recomputed in zip(*grads):
        assert torch.equal(plain, recomputed)
