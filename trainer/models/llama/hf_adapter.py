"""Llama <-> transformers' LlamaForCausalLM, and the MoE Llama <-> MixtralForCausalLM: config.json and
weight names.

Llama weight names map one to one onto `transformers`' `LlamaForCausalLM`. No reordering of the query/key
projections is needed: this model's RoPE rotates channel pairs (i, i + head_dim/2), Hugging Face's
`rotate_half` layout (Meta's original checkpoints pair neighbouring channels, which is what the usual
conversion scripts permute away).

Mixture-of-Experts Llamas (`model.n_experts > 0`, no shared experts) are Mixtral: `MixtralForCausalLM`
with the Hub's layout, the router as `block_sparse_moe.gate` and expert j's SwiGLU as
`block_sparse_moe.experts.<j>.w1/w2/w3` (our experts are stacked [E, ...] tensors, split on export and
stacked again on import; transformers >= 5 fuses them itself when loading). Configs Mixtral cannot
express (shared experts, top-1, no renormalisation, a selection bias, a capacity factor) are refused.

This module only maps names and configs (no file I/O): `trainer.checkpoint.hf` drives export and import
through it (the Llama family's `hf_adapter`), and raises the `ValueError`s here as checkpoint errors.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from trainer.interfaces.hf_adapter import HFAdapter
from trainer.models.llama.model import LlamaConfig

# Per-layer names: ours -> Hugging Face's (under `model.layers.<i>.`).
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    # Mixtral's router
    "feed_forward.router.weight": "block_sparse_moe.gate.weight",
}
_LAYER_BACK = {theirs: ours for ours, theirs in _LAYER_NAMES.items()}
_GLOBAL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GLOBAL_BACK = {theirs: ours for ours, theirs in _GLOBAL_NAMES.items()}
# A tied head (tie_embeddings) is the embedding: transformers ties lm_head to embed_tokens itself.
_TIED = ("output.weight", "tok_embeddings.weight")
_EXPERT_WEIGHTS = ("w1", "w2", "w3")  # ours feed_forward.experts.<w> [E, ...] <-> experts.<j>.<w>.weight
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


def expert_weight(name: str) -> Optional[tuple[int, str]]:
    """(layer, w1|w2|w3) when `name` is one of our stacked expert weights, else None."""
    match = _LAYER.match(name)
    if match and match.group(2).startswith("feed_forward.experts.") and match.group(2).split(".")[-1] in _EXPERT_WEIGHTS:
        return int(match.group(1)), match.group(2).split(".")[-1]
    return None


def hf_expert_name(layer: int, expert: int, weight: str) -> str:
    """Hugging Face Mixtral's name of expert `expert`'s `weight` (w1, w2, w3) in layer `layer`."""
    return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{weight}.weight"


class LlamaHFAdapter(HFAdapter):
    """Llama (LlamaForCausalLM) and Mixtral (MixtralForCausalLM, an MoE Llama): the Hugging Face side of
    the Llama family (`trainer.interfaces.HFAdapter`)."""

    config_class = LlamaConfig
    model_types = ("llama", "mixtral")

    # ---- config.json --------------------------------------------------------------------------------
    def check(self, config: LlamaConfig) -> None:
        """Raise ValueError when an MoE config is not one Mixtral can express."""
        if not config.is_moe:
            return
        problems = []
        if config.n_shared_experts:
            problems.append("shared experts")
        if config.top_k == 1 or not config.router_renormalize:
            problems.append("router weights not renormalised over the top-k (Mixtral renormalises, top_k >= 2)")
        if config.router_bias_update_rate > 0:
            problems.append("an auxiliary-loss-free selection bias")
        if config.capacity_factor > 0:
            problems.append("a capacity factor (Mixtral is dropless)")
        if problems:
            raise ValueError("this Mixture of Experts has no Hugging Face Mixtral counterpart: " + "; ".join(problems))

    def hf_config(self, config: LlamaConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """`config.json` of LlamaForCausalLM (MixtralForCausalLM for an MoE) for our Llama config."""
        common = {
            "vocab_size": config.vocab_size,
            "hidden_size": config.dim,
            "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads,
            "num_key_value_heads": config.num_kv_heads,
            "head_dim": config.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": config.max_seq_len,
            "rms_norm_eps": config.norm_eps,
            # transformers < 5 reads rope_theta, >= 5 rope_parameters
            "rope_theta": config.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
            "tie_word_embeddings": config.tie_embeddings,
            "initializer_range": config.init_std,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        if config.is_moe:
            self.check(config)
            return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **common,
                    "intermediate_size": config.expert_hidden_dim, "sliding_window": None,
                    "num_local_experts": config.n_experts, "num_experts_per_tok": config.top_k,
                    "router_aux_loss_coef": config.router_aux_loss_coef, "output_router_logits": False}
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
                "intermediate_size": config.hidden_dim, "attention_bias": False, "mlp_bias": False}

    def config_from_hf(self, hf: dict[str, Any], name: str = "hf") -> LlamaConfig:
        """Our Llama config for a Hugging Face `config.json` (Llama or Mixtral; plain RoPE, no biases; one
        without `model_type` is read as a Llama); ValueError for what this model does not implement."""
        if hf.get("model_type") not in (None, *self.model_types):
            raise ValueError(f"model_type={hf.get('model_type')!r}: only Hugging Face Llama and Mixtral models "
                             "can be imported")
        moe: dict[str, Any] = {}
        if hf.get("model_type") == "mixtral":
            if hf.get("sliding_window"):
                raise ValueError(f"sliding_window={hf['sliding_window']}: sliding-window attention is not implemented")
            moe = dict(n_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                       moe_hidden_dim=hf["intermediate_size"],
                       router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.02))
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"RoPE scaling {rope_type!r} is not implemented by this model (only plain RoPE)")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ValueError("Llama variants with attention or MLP biases are not supported")
        head_dim = hf.get("head_dim")
        if head_dim is not None and head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
            raise ValueError(f"head_dim={head_dim} x heads != hidden_size: not supported by this model")
        return LlamaConfig(
            name=name,
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads"),
            ffn_hidden_dim=hf["intermediate_size"],
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            max_seq_len=hf.get("max_position_embeddings", 4096),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=hf.get("initializer_range", 0.02),
            **moe,
        )

    def ignored_mismatch_fields(self, config: LlamaConfig) -> tuple[str, ...]:
        # the dense SwiGLU width is unused by an MoE (Mixtral's intermediate_size is the experts')
        return ("ffn_hidden_dim", "multiple_of", "ffn_dim_multiplier") if config.is_moe else ()

    # ---- weight names -------------------------------------------------------------------------------
    def skipped(self, name: str) -> bool:
        return name.endswith("expert_bias")  # the auxiliary-loss-free selection bias (`check` refuses a used one)

    def tied_source(self, config: LlamaConfig, name: str) -> Optional[str]:
        """A tied head reads the embedding (transformers ties lm_head to embed_tokens itself)."""
        return _TIED[1] if name == _TIED[0] and config.tie_embeddings else None

    def hf_name(self, name: str) -> str:
        """Hugging Face's name of one of our Llama weights (Mixtral's router for an MoE layer's; the
        stacked experts have one name per expert: `stacked_hf_names`)."""
        if name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[name]
        match = _LAYER.match(name)
        if match and match.group(2) in _LAYER_NAMES:
            return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
        raise KeyError(f"{name} has no Hugging Face Llama counterpart")

    def stacked_hf_names(self, name: str, count: int) -> Optional[list[str]]:
        expert = expert_weight(name)
        return None if expert is None else [hf_expert_name(expert[0], j, expert[1]) for j in range(count)]

    def our_name(self, hf_name: str) -> tuple[str, Optional[int]]:
        """Our name of a Hugging Face Llama / Mixtral weight, and the expert index when it is one slice of
        a stacked expert weight (else None)."""
        if hf_name in _GLOBAL_BACK:
            return _GLOBAL_BACK[hf_name], None
        match = _HF_LAYER.match(hf_name)
        if match:
            layer, rest = match.groups()
            if rest in _LAYER_BACK:
                return f"layers.{layer}.{_LAYER_BACK[rest]}", None
            expert = _HF_EXPERT.match(rest)
            if expert:
                return f"layers.{layer}.feed_forward.experts.{expert.group(2)}", int(expert.group(1))
        raise KeyError(f"{hf_name} is not a Hugging Face Llama weight this model has")
