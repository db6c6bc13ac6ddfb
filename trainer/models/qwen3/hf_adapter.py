"""Qwen3 <-> transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM: config.json and weight names.

The weight names are those of the Hub checkpoints (what `save_pretrained` writes and `from_pretrained`
reads): one tensor per expert, `model.layers.<i>.mlp.experts.<j>.{gate,up,down}_proj.weight`, and the
router as `mlp.gate.weight`. Our experts are stacked `[E, ...]` tensors (`GroupedExperts` w1 = gate,
w3 = up, w2 = down), split on export and stacked on import (transformers >= 5 fuses gate and up into
`gate_up_proj` in memory itself when it loads). Nothing is permuted: our RoPE is rotate-half, as theirs.

This module only maps names and configs (no file I/O, no checkpoint imports): `trainer.checkpoint.hf`
drives export and import through it (the Qwen3 family's `hf_adapter`), and raises the `ValueError`s here
as checkpoint errors.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from trainer.interfaces.hf_adapter import HFAdapter, transformers_fused_experts
from trainer.models.qwen3.model import Qwen3Config

_GLOBAL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Per layer: ours -> transformers' (under `model.layers.<i>.`); biases exist with attention_bias only.
_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    # dense SwiGLU (every layer of a dense model, mlp_only_layers of an MoE)
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    # MoE router
    "feed_forward.router.weight": "mlp.gate.weight",
}
_LAYER_BACK = {theirs: ours for ours, theirs in _LAYER.items()}
# Stacked expert weights: ours (feed_forward.experts.<w>, [E, ...]) -> transformers' per-expert projection.
_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERTS_BACK = {theirs: ours for ours, theirs in _EXPERTS.items()}
_OURS = re.compile(r"^layers\.(\d+)\.(.+)$")
_THEIRS = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_THEIR_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Qwen3HFAdapter(HFAdapter):
    """The Hugging Face side of the Qwen3 family (`trainer.interfaces.HFAdapter`)."""

    config_class = Qwen3Config
    model_types = ("qwen3", "qwen3_moe")

    # ---- config.json --------------------------------------------------------------------------------
    def hf_config(self, config: Qwen3Config, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """`config.json` of Qwen3ForCausalLM, or Qwen3MoeForCausalLM when the model has experts."""
        common: dict[str, Any] = {
            "vocab_size": config.vocab_size,
            "hidden_size": config.dim,
            "intermediate_size": config.ffn_hidden_dim,
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
            "attention_bias": config.attention_bias,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": config.n_layers,
            "initializer_range": config.init_std,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        if config.n_experts == 0:
            return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **common}
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **common,
                "num_experts": config.n_experts, "num_experts_per_tok": config.top_k,
                "moe_intermediate_size": config.moe_hidden_dim, "norm_topk_prob": config.norm_topk_prob,
                "decoder_sparse_step": config.decoder_sparse_step, "mlp_only_layers": list(config.mlp_only_layers),
                "router_aux_loss_coef": config.router_aux_loss_coef,
                # as in the published Qwen3-MoE configs: transformers then returns no router logits and
                # adds no aux loss unless a fine-tuning run turns it on
                "output_router_logits": False}

    def config_from_hf(self, hf: dict[str, Any], name: str = "hf") -> Qwen3Config:
        """Our config for a transformers Qwen3 / Qwen3-MoE `config.json`; ValueError for what this model
        does not implement (sliding-window layers, RoPE scaling, attention dropout, another activation)."""
        model_type = hf.get("model_type")
        if model_type not in self.model_types:
            raise ValueError(f"model_type={model_type!r} is not a Qwen3 model ({', '.join(self.model_types)})")
        if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or []):
            raise ValueError("sliding-window attention layers are not implemented by this model")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"RoPE scaling {rope_type!r} is not implemented by this model (only plain RoPE)")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={hf['hidden_act']!r}: Qwen3's SwiGLU uses silu")
        if hf.get("attention_dropout", 0.0):
            raise ValueError(f"attention_dropout={hf['attention_dropout']} is not implemented by this model")
        moe: dict[str, Any] = {}
        if model_type == "qwen3_moe":
            moe = dict(n_experts=hf.get("num_experts", hf.get("num_local_experts")),
                       top_k=hf["num_experts_per_tok"], moe_hidden_dim=hf["moe_intermediate_size"],
                       norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                       decoder_sparse_step=hf.get("decoder_sparse_step", 1),
                       mlp_only_layers=list(hf.get("mlp_only_layers") or []),
                       router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))
        heads = hf["num_attention_heads"]
        return Qwen3Config(
            name=name,
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=hf.get("num_key_value_heads") or heads,
            # transformers' rule when config.json has none
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            ffn_hidden_dim=hf["intermediate_size"],
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            max_seq_len=hf.get("max_position_embeddings", 32768),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            init_std=hf.get("initializer_range", 0.02),
            **moe,
        )

    def ignored_mismatch_fields(self, config: Qwen3Config) -> tuple[str, ...]:
        """Config fields that do not change any tensor of this config (an init_from need not agree)."""
        if config.n_experts == 0:  # the MoE options of a dense model are unused
            return ("top_k", "moe_hidden_dim", "decoder_sparse_step", "mlp_only_layers")
        if all(config.is_sparse_layer(i) for i in range(config.n_layers)):  # no dense layer
            return ("ffn_hidden_dim",)
        return ()

    # ---- weight names -------------------------------------------------------------------------------
    def skipped(self, name: str) -> bool:
        """Our tensors that have no transformers counterpart (the MoE selection bias buffer, which Qwen3
        never uses: it is only saved when a bias update rate is set, which Qwen3Config has not)."""
        return name.endswith("expert_bias")

    def tied_source(self, config: Qwen3Config, name: str) -> Optional[str]:
        """A tied head reads the embedding (transformers ties lm_head to embed_tokens itself)."""
        return "tok_embeddings.weight" if name == "output.weight" and config.tie_embeddings else None

    def hf_name(self, name: str) -> str:
        """transformers' name of one of our (non-stacked) weights."""
        if name in _GLOBAL:
            return _GLOBAL[name]
        match = _OURS.match(name)
        if match and match.group(2) in _LAYER:
            return f"model.layers.{match.group(1)}.{_LAYER[match.group(2)]}"
        raise KeyError(f"{name} has no Hugging Face Qwen3 counterpart")

    def stacked_hf_names(self, name: str, count: int) -> Optional[list[str]]:
        """For a stacked expert weight `layers.<i>.feed_forward.experts.<w>` ([count, ...]), transformers'
        name of each slice along dim 0 (one per expert); None for every other weight."""
        match = _OURS.match(name)
        if not match or not match.group(2).startswith("feed_forward.experts."):
            return None
        weight = match.group(2).rsplit(".", 1)[1]
        return [f"model.layers.{match.group(1)}.mlp.experts.{j}.{_EXPERTS[weight]}.weight" for j in range(count)]

    def fused_hf_tensor(self, name: str) -> Optional[tuple[str, int, int]]:
        """transformers (>= 5)'s fused `mlp.experts.gate_up_proj` / `mlp.experts.down_proj` holding a
        stacked expert weight."""
        names = self.stacked_hf_names(name, 1)
        return None if names is None else transformers_fused_experts(names[0])

    def our_name(self, hf_name: str) -> tuple[str, Optional[int]]:
        """Our name of a transformers weight, and the expert index when it is one slice of a stacked
        weight (else None)."""
        for ours, theirs in _GLOBAL.items():
            if hf_name == theirs:
                return ours, None
        match = _THEIRS.match(hf_name)
        if match:
            layer, rest = match.groups()
            if rest in _LAYER_BACK:
                return f"layers.{layer}.{_LAYER_BACK[rest]}", None
            expert = _THEIR_EXPERT.match(rest)
            if expert:
                return f"layers.{layer}.feed_forward.experts.{_EXPERTS_BACK[expert.group(2)]}", int(expert.group(1))
        raise KeyError(f"{hf_name} is not a Hugging Face Qwen3 weight this model has")

    # ---- whole state dicts (full tensors) ----------------------------------------------------------------
    def to_hf(self, state: dict[str, torch.Tensor], config: Qwen3Config) -> dict[str, torch.Tensor]:
        """Our full state dict -> transformers' (Hub layout); a tied head is left to transformers' tying."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            if self.tied_source(config, name) is not None or self.skipped(name):
                continue
            names = self.stacked_hf_names(name, tensor.shape[0])
            if names is None:
                out[self.hf_name(name)] = tensor
            else:
                out.update({hf: tensor[j] for j, hf in enumerate(names)})
        return out

    def from_hf(self, hf_state: dict[str, torch.Tensor], config: Qwen3Config) -> dict[str, torch.Tensor]:
        """transformers' state dict (Hub layout) -> ours (experts stacked; a tied head shares the
        embedding tensor)."""
        state: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[int, torch.Tensor]] = {}
        for hf_name, tensor in hf_state.items():
            if hf_name == "lm_head.weight" and config.tie_embeddings:
                continue
            ours, expert = self.our_name(hf_name)
            if expert is None:
                state[ours] = tensor
            else:
                experts.setdefault(ours, {})[expert] = tensor
        for ours, slices in experts.items():
            if sorted(slices) != list(range(config.n_experts)):
                raise ValueError(f"{ours}: experts {sorted(slices)} found, {config.n_experts} expected")
            state[ours] = torch.stack([slices[j] for j in range(config.n_experts)])
        if config.tie_embeddings:
            state["output.weight"] = state["tok_embeddings.weight"]
        return state
