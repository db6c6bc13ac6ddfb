"""Hugging Face models: export to (and import from) `config.json` + `model.safetensors`.

Each model family that has a transformers counterpart registers an adapter (`trainer.interfaces.HFAdapter`:
config.json both ways, weight names, stacked weights split into per-expert tensors, weights a directory may
lack, extra tensors of a published layout) in `ADAPTERS`, keyed by its config class; export and import
below are family-agnostic and go through it. Llama / Mixtral (`LlamaHFAdapter`, this module), Qwen3 /
Qwen3-MoE (`trainer/models/qwen3/hf_adapter.py`) and DeepSeek-V3 (`trainer/models/deepseek_v3/hf_adapter.py`)
are registered.

Llama weight names map one to one onto `transformers`' `LlamaForCausalLM`. No reordering of the query/key
projections is needed: this model's RoPE rotates channel pairs (i, i + head_dim/2), Hugging Face's
`rotate_half` layout (Meta's original checkpoints pair neighbouring channels, which is what the usual
conversion scripts permute away).

    python -m trainer.checkpoint.hf export CHECKPOINT_DIR OUT_DIR   # a committed checkpoint -> HF

Import goes through DCP's `HuggingFaceStorageReader`, so the safetensors load straight into whatever
layout the run uses (FSDP shards, tensor-parallel slices, pipeline stages): `init_from=HF_DIR`.

Mixture-of-Experts Llamas (`model.n_experts > 0`, no shared experts) are Mixtral: `MixtralForCausalLM`
with the Hub's layout, the router as `block_sparse_moe.gate` and expert j's SwiGLU as
`block_sparse_moe.experts.<j>.w1/w2/w3` (our experts are stacked [E, ...] tensors, split on export and
stacked again on import; transformers >= 5 fuses them itself when loading).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from trainer.checkpoint.manifest import CheckpointError, read_manifest, verify_files
from trainer.interfaces.hf_adapter import HFAdapter
from trainer.models.deepseek_v3.hf_adapter import DeepSeekV3HFAdapter
from trainer.models.llama import LlamaConfig
from trainer.models.qwen3.hf_adapter import Qwen3HFAdapter

if TYPE_CHECKING:
    from trainer.loop import Trainer

log = logging.getLogger("trainer")

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
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
}
_GLOBAL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_MIXTRAL_ROUTER = ("feed_forward.router.weight", "block_sparse_moe.gate.weight")
_EXPERT_WEIGHTS = ("w1", "w2", "w3")  # ours feed_forward.experts.<w> [E, ...] <-> experts.<j>.<w>.weight
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def expert_weight(name: str) -> Optional[tuple[int, str]]:
    """(layer, w1|w2|w3) when `name` is one of our stacked expert weights, else None."""
    match = _LAYER.match(name)
    if match and match.group(2).startswith("feed_forward.experts.") and match.group(2).split(".")[-1] in _EXPERT_WEIGHTS:
        return int(match.group(1)), match.group(2).split(".")[-1]
    return None


def hf_expert_name(layer: int, expert: int, weight: str) -> str:
    """Hugging Face Mixtral's name of expert `expert`'s `weight` (w1, w2, w3) in layer `layer`."""
    return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{weight}.weight"


def to_hf_name(name: str) -> str:
    """Hugging Face's name of one of our Llama weights (Mixtral's router for an MoE layer's; the stacked
    experts have one name per expert: `hf_expert_name`)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER.match(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    if match and match.group(2) == _MIXTRAL_ROUTER[0]:
        return f"model.layers.{match.group(1)}.{_MIXTRAL_ROUTER[1]}"
    raise KeyError(f"{name} has no Hugging Face Llama counterpart")


def from_hf_name(name: str) -> str:
    """Our name of a Hugging Face Llama weight."""
    for ours, theirs in _GLOBAL_NAMES.items():
        if name == theirs:
            return ours
    match = _HF_LAYER.match(name)
    if match:
        for ours, theirs in _LAYER_NAMES.items():
            if match.group(2) == theirs:
                return f"layers.{match.group(1)}.{ours}"
        if match.group(2) == _MIXTRAL_ROUTER[1]:
            return f"layers.{match.group(1)}.{_MIXTRAL_ROUTER[0]}"
    raise KeyError(f"{name} is not a Hugging Face Llama weight this model has")


def check_mixtral(config: LlamaConfig) -> None:
    """Raise CheckpointError when an MoE config is not one Mixtral can express."""
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
        raise CheckpointError("this Mixture of Experts has no Hugging Face Mixtral counterpart: " + "; ".join(problems))


def hf_config(config: LlamaConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
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
        check_mixtral(config)
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **common,
                "intermediate_size": config.expert_hidden_dim, "sliding_window": None,
                "num_local_experts": config.n_experts, "num_experts_per_tok": config.top_k,
                "router_aux_loss_coef": config.router_aux_loss_coef, "output_router_logits": False}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
            "intermediate_size": config.hidden_dim, "attention_bias": False, "mlp_bias": False}


def llama_config_from_hf(hf: dict[str, Any], name: str = "hf") -> LlamaConfig:
    """Our Llama config for a Hugging Face `config.json` (Llama or Mixtral; plain RoPE, no biases)."""
    if hf.get("model_type") not in (None, "llama", "mixtral"):
        raise CheckpointError(f"model_type={hf.get('model_type')!r}: only Hugging Face Llama and Mixtral models "
                              "can be imported")
    moe: dict[str, Any] = {}
    if hf.get("model_type") == "mixtral":
        if hf.get("sliding_window"):
            raise CheckpointError(f"sliding_window={hf['sliding_window']}: sliding-window attention is not implemented")
        moe = dict(n_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                   moe_hidden_dim=hf["intermediate_size"],
                   router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.02))
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"RoPE scaling {rope_type!r} is not implemented by this model (only plain RoPE)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise CheckpointError("Llama variants with attention or MLP biases are not supported")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
        raise CheckpointError(f"head_dim={head_dim} x heads != hidden_size: not supported by this model")
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


# ---- the adapter registry ------------------------------------------------------------------------------
class LlamaHFAdapter(HFAdapter):
    """Llama (LlamaForCausalLM) and Mixtral (MixtralForCausalLM, an MoE Llama): the functions above."""

    config_class = LlamaConfig
    model_types = ("llama", "mixtral")

    def check(self, config: LlamaConfig) -> None:
        check_mixtral(config)

    def hf_config(self, config: LlamaConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        return hf_config(config, dtype)

    def config_from_hf(self, hf: dict[str, Any], name: str = "hf") -> LlamaConfig:
        return llama_config_from_hf(hf, name)

    def ignored_mismatch_fields(self, config: LlamaConfig) -> tuple[str, ...]:
        # the dense SwiGLU width is unused by an MoE (Mixtral's intermediate_size is the experts')
        return ("ffn_hidden_dim", "multiple_of", "ffn_dim_multiplier") if config.is_moe else ()

    def skipped(self, name: str) -> bool:
        return name.endswith("expert_bias")  # the auxiliary-loss-free selection bias (check_mixtral refuses a used one)

    def hf_name(self, name: str) -> str:
        return to_hf_name(name)

    def stacked_hf_names(self, name: str, count: int) -> Optional[list[str]]:
        expert = expert_weight(name)
        return None if expert is None else [hf_expert_name(expert[0], j, expert[1]) for j in range(count)]


# Keyed by our config class; `adapter_for` also finds one by its class name (a checkpoint's manifest) or
# by the `model_type` of a config.json.
ADAPTERS: dict[type, HFAdapter] = {adapter.config_class: adapter for adapter in (
    LlamaHFAdapter(), Qwen3HFAdapter(), DeepSeekV3HFAdapter())}


def adapter_for(config: Any = None, *, class_name: Optional[str] = None, model_type: Optional[str] = None) -> HFAdapter:
    """The adapter of a config instance, of a config class name, or of a config.json `model_type`
    (CheckpointError when no family has one)."""
    for config_class, adapter in ADAPTERS.items():
        if ((config is not None and type(config) is config_class) or class_name == config_class.__name__
                or (model_type is not None and model_type in adapter.model_types)):
            return adapter
    if model_type is not None:
        what = f"model_type={model_type!r}"
    else:
        what = type(config).__name__ if config is not None else str(class_name)
    families = ", ".join(sorted(t for adapter in ADAPTERS.values() for t in adapter.model_types))
    raise CheckpointError(f"{what} has no Hugging Face counterpart here (the Hugging Face families: {families})")


def config_from_hf(hf: dict[str, Any], name: str = "hf") -> Any:
    """Our config for a Hugging Face `config.json` of any registered family (a config without
    `model_type` is read as a Llama)."""
    adapter = adapter_for(model_type=hf.get("model_type") or "llama")
    try:
        return adapter.config_from_hf(hf, name)
    except ValueError as error:
        raise CheckpointError(str(error)) from None


def read_hf_config(directory: Path | str) -> Any:
    """Our config for the Hugging Face model in `directory` (its config.json)."""
    directory = Path(directory)
    return config_from_hf(json.loads((directory / CONFIG_FILE).read_text()), name=directory.name)


def is_hf_model(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() and any(path.glob("*.safetensors"))


# ---- export -------------------------------------------------------------------------------------------
def export_state_dict(state: dict[str, torch.Tensor], config: Any, out_dir: Path | str,
                      dtype: Optional[torch.dtype] = None) -> Path:
    """Write full (unsharded) weights with our names as the Hugging Face model of `config`'s family in
    `out_dir`."""
    from safetensors.torch import save_file

    adapter = adapter_for(config)
    try:
        adapter.check(config)
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ours = {name: tensor.detach().to("cpu") if dtype is None else tensor.detach().to("cpu", dtype)
            for name, tensor in state.items()}
    tensors = {}
    for name, tensor in ours.items():
        if name == "output.weight" and config.tie_embeddings:
            continue  # HF ties lm_head to embed_tokens itself
        if adapter.skipped(name):
            continue
        stacked = adapter.stacked_hf_names(name, tensor.shape[0]) if tensor.ndim else None
        if stacked is not None:  # one tensor per expert, as the Hub's MoE checkpoints hold them
            for index, hf_name in enumerate(stacked):
                tensors[hf_name] = tensor[index].contiguous()
            continue
        try:
            tensors[adapter.hf_name(name)] = tensor.contiguous()
        except KeyError as error:
            raise CheckpointError(str(error).strip("'\"")) from None
    tensors.update(adapter.extra_tensors(config, ours))
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    saved_dtype = dtype or next(iter(tensors.values())).dtype
    (out_dir / CONFIG_FILE).write_text(json.dumps(adapter.hf_config(config, saved_dtype), indent=2) + "\n")
    return out_dir


def export_trainer(trainer: "Trainer", out_dir: Path | str, dtype: Optional[torch.dtype] = None) -> Optional[Path]:
    """Export a running trainer's model (collective: the shards are gathered; rank 0 writes)."""
    from trainer.checkpoint.state import model_config_dict

    state = trainer.strategy.full_state_dict(trainer.model_parts)
    saved = dict(model_config_dict(trainer) or {})
    class_name = saved.pop("class", None)
    path = None
    if trainer.is_global_zero:
        config = adapter_for(class_name=class_name).config_class(**saved)
        path = export_state_dict(state, config, out_dir, dtype)
    trainer.strategy.barrier()
    return path


def export_checkpoint(checkpoint: Path | str, out_dir: Path | str, dtype: Optional[torch.dtype] = None) -> Path:
    """Convert a committed checkpoint (any strategy, any world size) into a Hugging Face model, on one
    process: DCP reads every shard into full tensors."""
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.storage import SafeFileSystemReader, WeightsOnlyLoadPlanner, dcp_call
    from trainer.models import build_model

    checkpoint = Path(checkpoint)
    manifest = read_manifest(checkpoint)
    # Every file against its recorded size and CRC first: DCP reads by offset, so a truncated or altered
    # shard could otherwise be exported as wrong weights without an error.
    verify_files(checkpoint, sorted(manifest["files"]), manifest)
    saved = dict(manifest.get("model") or {})
    class_name = saved.pop("class", None)
    if class_name is None:
        raise CheckpointError(f"{checkpoint} records no model architecture")
    config = adapter_for(class_name=class_name).config_class(**saved)
    with torch.device("cpu"):
        model = build_model(config)
    state = {f"model.{key}": value for key, value in model.state_dict().items()}
    with dcp_call():
        dcp.load(state, storage_reader=SafeFileSystemReader(checkpoint), planner=WeightsOnlyLoadPlanner(), no_dist=True)
    return export_state_dict({key[len("model."):]: value for key, value in state.items()}, config, out_dir, dtype)


# ---- import -------------------------------------------------------------------------------------------
def load_hf_weights(trainer: "Trainer", directory: Path | str) -> None:
    """Load a Hugging Face model's weights into the trainer's model parts (collective).

    Each rank reads only the slices its layout holds (DCP's HuggingFaceStorageReader), so this works
    under every strategy. The model's architecture must match `config.json`.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    from trainer.checkpoint.state import architecture_mismatch, load_model_state, model_config_dict, model_state
    from trainer.checkpoint.storage import dcp_call

    directory = Path(directory)
    theirs = read_hf_config(directory)
    adapter = adapter_for(theirs)
    saved, current = {"class": type(theirs).__name__, **dataclasses.asdict(theirs)}, dict(model_config_dict(trainer) or {})
    for key in adapter.ignored_mismatch_fields(theirs):
        saved.pop(key, None)
        current.pop(key, None)
    problems = architecture_mismatch(saved, current)
    if problems:
        raise CheckpointError(f"{directory} holds another architecture than this run's model: " + "; ".join(problems))
    ours = model_state(trainer.model_parts)
    stacked = {key: names for key, value in ours.items()
               if value.ndim and (names := adapter.stacked_hf_names(key, value.shape[0])) is not None}
    # A tied head has no lm_head entry: it reads embed_tokens (a pipeline's last stage holds its own copy).
    names = {key: adapter.hf_name("tok_embeddings.weight" if key == "output.weight" and theirs.tie_embeddings else key)
             for key in ours if key not in stacked and not adapter.skipped(key)}
    available = _tensor_names(directory)
    # optional weights the directory lacks keep their initialization (e.g. DeepSeek-V3's MTP module, which
    # transformers' save_pretrained does not write)
    absent = [key for key, hf_name in names.items() if hf_name not in available and adapter.optional(key)]
    absent += [key for key, hf_names in stacked.items() if adapter.optional(key)
               and not any(name in available for name in hf_names) and _fused_expert_name(hf_names[0]) not in available]
    if absent:
        log.warning(f"{directory} has no weights for {len(absent)} tensors (e.g. {absent[0]}): they keep their "
                    "initialization")
    template = {hf_name: ours[key] for key, hf_name in names.items() if key not in absent}
    with dcp_call() as no_dist:
        dcp.load(template, storage_reader=HuggingFaceStorageReader(str(directory)), planner=DefaultLoadPlanner(),
                 no_dist=no_dist)
    loaded = {key: template[hf_name] for key, hf_name in names.items() if key not in absent}
    loaded.update({key: _read_stacked(directory, key, hf_names, ours[key]) for key, hf_names in stacked.items()
                   if key not in absent})
    loaded.update({key: value for key, value in ours.items() if adapter.skipped(key) or key in absent})
    load_model_state(trainer.model_parts, loaded)


def _tensor_names(directory: Path) -> set[str]:
    """The tensor names of a directory's safetensors files (read from their headers)."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


_PER_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")


def _fused_expert_name(hf_name: str) -> Optional[str]:
    """transformers (>= 5)'s fused tensor holding the per-expert `hf_name`: `<...>.experts.gate_up_proj`
    ([E, 2 x hidden, dim], the gate rows first) or `<...>.experts.down_proj` ([E, dim, hidden]); None for
    names of another layout (Mixtral's w1/w2/w3)."""
    match = _PER_EXPERT.match(hf_name)
    if match is None:
        return None
    return f"{match.group(1)}.{'down_proj' if match.group(2) == 'down_proj' else 'gate_up_proj'}"


def _read_stacked(directory: Path, key: str, hf_names: list[str], like: torch.Tensor) -> torch.Tensor:
    """Our stacked weight `key` from its per-expert tensors `hf_names` (or from the fused tensor
    transformers >= 5 saves), in `like`'s layout (a DTensor keeps its mesh and placements: each rank
    keeps its part of the full tensor)."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor

    wanted = {name: index for index, name in enumerate(hf_names)}
    fused_name = _fused_expert_name(hf_names[0])
    pieces: dict[int, torch.Tensor] = {}
    fused: Optional[torch.Tensor] = None
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name in wanted:
                    pieces[wanted[name]] = f.get_tensor(name)
                elif name == fused_name:
                    fused = f.get_tensor(name)
    if len(pieces) == len(hf_names):
        full = torch.stack([pieces[e] for e in range(len(hf_names))])
    elif not pieces and fused is not None and fused_name is not None:
        if fused_name.endswith("down_proj"):
            full = fused
        else:
            gate, up = fused.chunk(2, dim=1)
            full = up if hf_names[0].endswith(".up_proj.weight") else gate
    else:
        missing = [name for name, index in wanted.items() if index not in pieces]
        raise CheckpointError(f"{directory} lacks {len(missing)} expert tensors of {key}, e.g. {missing[0]}")
    full = full.to(like.dtype)
    if isinstance(like, DTensor):
        return distribute_tensor(full.to(like.device_mesh.device_type), like.device_mesh, like.placements,
                                 src_data_rank=None)
    return full.to(like.device)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.checkpoint.hf",
                                     description="Convert a checkpoint into a Hugging Face model (Llama, Mixtral, Qwen3, Qwen3-MoE, DeepSeek-V3).")
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="checkpoint directory -> config.json + model.safetensors")
    export.add_argument("checkpoint", type=Path)
    export.add_argument("out_dir", type=Path)
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out_dir, getattr(torch, args.dtype) if args.dtype else None)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    print(out)


if __name__ == "__main__":
    main()
