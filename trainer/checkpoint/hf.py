"""Hugging Face models: export to (and import from) `config.json` + `model.safetensors`.

Each model family that has a transformers counterpart declares an adapter (`trainer.interfaces.HFAdapter`:
config.json both ways, weight names, stacked weights split into per-expert tensors, tied weights, weights a
directory may lack, extra tensors of a published layout) as its `hf_adapter`
(`trainer.interfaces.ModelFamily`), found through `trainer.models.FAMILIES`. Export and import below are
family-agnostic and go through it: this module names no weight. Each family's names and config fields live
in its folder: Llama / Mixtral in `trainer/models/llama/hf_adapter.py`, Qwen3 / Qwen3-MoE in
`trainer/models/qwen3/hf_adapter.py`, DeepSeek-V3 in `trainer/models/deepseek_v3/hf_adapter.py`; GPT has no
adapter (`hf_adapter = None`: no export of GPT-2 models here).

    python -m trainer.checkpoint.hf export CHECKPOINT_DIR OUT_DIR   # a committed checkpoint -> HF

Import goes through DCP's `HuggingFaceStorageReader`, so the safetensors load straight into whatever
layout the run uses (FSDP shards, tensor-parallel slices, pipeline stages): `init_from=HF_DIR`. Stacked
(expert) weights are read with `safetensors` from their per-expert tensors, or from the fused tensor the
adapter names (`HFAdapter.fused_hf_tensor`, transformers >= 5), and distributed into the run's layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from trainer.checkpoint.manifest import CheckpointError, read_manifest, verify_files
from trainer.interfaces.hf_adapter import HFAdapter
from trainer.models import FAMILIES, family_of

if TYPE_CHECKING:
    from trainer.loop import Trainer

log = logging.getLogger("trainer")

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# config.json without `model_type` (early Llama conversions): read as this type.
DEFAULT_MODEL_TYPE = "llama"


# ---- the families' adapters ------------------------------------------------------------------------------
def _model_types() -> str:
    return ", ".join(sorted(t for family in FAMILIES.values() if family.hf_adapter is not None
                            for t in family.hf_adapter.model_types))


def adapter_for(config: Any = None, *, class_name: Optional[str] = None, model_type: Optional[str] = None) -> HFAdapter:
    """The adapter of a config instance's family, of a config class name's (a checkpoint's manifest), or of a
    config.json `model_type` (CheckpointError when no family has one)."""
    family = None
    if config is not None:
        try:
            family = family_of(config)
        except TypeError:
            pass
        what = type(config).__name__
    elif class_name is not None:
        family = next((f for f in FAMILIES.values() if f.config_class.__name__ == class_name), None)
        what = class_name
    else:
        family = next((f for f in FAMILIES.values() if f.hf_adapter is not None and model_type in f.hf_adapter.model_types),
                      None)
        what = f"model_type={model_type!r}"
    if family is not None and family.hf_adapter is not None:
        return family.hf_adapter
    why = "" if family is None else f" (the {family.name} family declares no Hugging Face adapter)"
    raise CheckpointError(f"{what} has no Hugging Face counterpart here{why}; the Hugging Face model types: "
                          f"{_model_types()}")


def config_from_hf(hf: dict[str, Any], name: str = "hf") -> Any:
    """Our config for a Hugging Face `config.json` of any family with an adapter (a config without
    `model_type` is read as `DEFAULT_MODEL_TYPE`)."""
    adapter = adapter_for(model_type=hf.get("model_type") or DEFAULT_MODEL_TYPE)
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
        if adapter.tied_source(config, name) is not None or adapter.skipped(name):
            continue  # a tied copy: transformers ties it itself
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
    saved_dtype = dtype or next(iter(tensors.values())).dtype
    try:
        hf = adapter.hf_config(config, saved_dtype)
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
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
    fused = {key: adapter.fused_hf_tensor(key) for key in stacked}
    # A tied copy (a tied head) has no entry of its own: it reads its source's tensor (a pipeline's last
    # stage holds its own copy).
    names = {key: adapter.hf_name(adapter.tied_source(theirs, key) or key)
             for key in ours if key not in stacked and not adapter.skipped(key)}
    available = _tensor_names(directory)
    # optional weights the directory lacks keep their initialization (e.g. DeepSeek-V3's MTP module, which
    # transformers' save_pretrained does not write)
    absent = [key for key, hf_name in names.items() if hf_name not in available and adapter.optional(key)]
    absent += [key for key, hf_names in stacked.items() if adapter.optional(key)
               and not any(name in available for name in hf_names)
               and (fused[key] is None or fused[key][0] not in available)]
    if absent:
        log.warning(f"{directory} has no weights for {len(absent)} tensors (e.g. {absent[0]}): they keep their "
                    "initialization")
    template = {hf_name: ours[key] for key, hf_name in names.items() if key not in absent}
    with dcp_call() as no_dist:
        dcp.load(template, storage_reader=HuggingFaceStorageReader(str(directory)), planner=DefaultLoadPlanner(),
                 no_dist=no_dist)
    loaded = {key: template[hf_name] for key, hf_name in names.items() if key not in absent}
    loaded.update({key: _read_stacked(directory, key, hf_names, fused[key], ours[key])
                   for key, hf_names in stacked.items() if key not in absent})
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


def _read_stacked(directory: Path, key: str, hf_names: list[str], fused: Optional[tuple[str, int, int]],
                  like: torch.Tensor) -> torch.Tensor:
    """Our stacked weight `key` from its per-expert tensors `hf_names` (or from the fused tensor `fused`
    = (name, parts along dim 1, ours) that the adapter names: transformers >= 5 saves those), in `like`'s
    layout (a DTensor keeps its mesh and placements: each rank keeps its part of the full tensor)."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor

    wanted = {name: index for index, name in enumerate(hf_names)}
    fused_name = fused[0] if fused is not None else None
    pieces: dict[int, torch.Tensor] = {}
    whole: Optional[torch.Tensor] = None
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name in wanted:
                    pieces[wanted[name]] = f.get_tensor(name)
                elif name == fused_name:
                    whole = f.get_tensor(name)
    if len(pieces) == len(hf_names):
        full = torch.stack([pieces[e] for e in range(len(hf_names))])
    elif not pieces and whole is not None and fused is not None:
        full = whole.chunk(fused[1], dim=1)[fused[2]]
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
                                     description="Convert a checkpoint into a Hugging Face model (model types: "
                                                 f"{_model_types()}).")
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
