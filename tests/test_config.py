"""Configuration: every option of every group composes and instantiates; invalid configs fail clearly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from trainer.data.config import source_config
from trainer.cli import preflight
from trainer.config import CONF_DIR, compose, group_options, total_steps, validate
from trainer.data.prepare import prepare
from trainer.models import build_meta_model
from trainer.optim import optimizer_from_config

GROUPS = ["model", "data", "strategy", "precision", "activation_checkpointing", "optimizer", "lr_schedule",
          "logger", "callbacks"]


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("text") / "corpus.txt"
    source.write_text("def f(x):\n    return x + 1\n" * 200)
    out = tmp_path_factory.mktemp("tokens")
    prepare([str(source)], str(out), tokenizer="bytes", val_fraction=0.1)  # val: 2 windows of 257
    return out


# Options that only make sense with more than one process.
OPTION_NEEDS = {
    ("strategy", "tp"): ["tp=2", "trainer.devices=2"],
    ("strategy", "pp"): ["pp=2", "trainer.devices=2"],
    ("strategy", "3d"): ["tp=2", "pp=2", "trainer.devices=4"],
    ("precision", "fp8"): ["precision.emulate=true"],  # this machine has no float8 matmuls
    # rollback (a default action) requires the checkpoint manager beside it (tests/test_stabilizer.py)
    ("callbacks", "stabilizer"): ["callbacks.stabilizer.actions=[skip,cooldown,abort]"],
}


def data_sources(option: str, token_dir: Path, tmp_path: Path) -> list[str]:
    """What each data option reads: the prepared tokens, also as Megatron and nanoGPT files."""
    from trainer.data import TokenFileDataset
    from trainer.data.formats import write_megatron

    ds = TokenFileDataset(str(token_dir))
    if option == "token_file":
        return [f"data.path={token_dir}"]
    if option == "mixture":
        return [f"data.sources=[{{path: {token_dir}, weight: 1}}]"]
    if option == "megatron":
        train = np.asarray(ds.train_tokens())
        write_megatron(tmp_path / "mt", [train[:2000], train[2000:]])
        return [f"data.path={tmp_path / 'mt'}", "data.vocab_size=256", "data.val_fraction=0.5"]
    if option == "nanogpt":
        np.asarray(ds.train_tokens()).tofile(tmp_path / "train.bin")
        np.asarray(ds.val_tokens()).tofile(tmp_path / "val.bin")
        return [f"data.path={tmp_path}", "data.vocab_size=256"]
    return []


def all_options() -> list[tuple[str, str]]:
    return [(group, option) for group in GROUPS for option in group_options(group)]


def test_composes_share_the_config_store_and_return_independent_configs() -> None:
    # Hydra deep-copies its repository on every compose; the ConfigStore inside is shared instead (a fifth
    # of a compose's time, trainer/config/registry.py), and what each compose returns stays its own.
    import copy

    from hydra.core.config_store import ConfigStore

    first = compose(["strategy=zero3"])
    assert copy.deepcopy(ConfigStore.instance()) is ConfigStore.instance()
    first.strategy.grad_sync = "microbatch"
    first.trainer.max_steps = 7
    second = compose(["strategy=zero3"])
    assert (second.strategy.grad_sync, second.trainer.max_steps) == ("auto", compose([]).trainer.max_steps)
    assert second.trainer.max_steps != 7


# Override lists whose values `compose` applies to a kept defaults list (trainer/config/compose.py): dotted
# and top-level values, additions, forced additions and deletions, a value before its group's choice, a
# list choice of a keyed group, a recipe, an interpolation, Hydra's own node, a structured-config type.
SPLIT_CASES = [
    ["model.dim=32", "model=gpt2_small", "tp=2", "strategy=3d"],
    ["callbacks=[checkpoint]", "callbacks.checkpoint.every_n_steps=3", "+callbacks.extra._target_=x.Y"],
    ["recipe=llama3_8b_8xh100", "trainer.devices=2", "tp=1", "mode=plan"],
    ["++trainer.new_key=1", "~callbacks.memory", "trainer.seq_len=${trainer.micro_batch_size}"],
    ["strategy=zero3", "hydra.run.dir=/tmp/x", "strategy.offload_params=true", "precision=bf16"],
    ["optimizer.lr=0.5", "optimizer=muon", "lr_schedule.warmup_steps=1"],
]
# Errors a user meets: an unknown option, an unknown key, a wrong type, an unparsable override.
SPLIT_ERRORS = [["strategy=nope"], ["trainer.max_stepz=3"], ["trainer.max_steps=lots"], ["model.dim=="]]


@pytest.mark.parametrize("overrides", SPLIT_CASES, ids=[o[0] for o in SPLIT_CASES])
def test_compose_of_a_kept_defaults_list_is_hydras_whole_composition(overrides: list[str]) -> None:
    from omegaconf import DictConfig, ListConfig

    from trainer.config.compose import _hydra_compose, _split_values

    def nodes(node: object, path: str = "") -> list[tuple[str, ...]]:
        """Every node's path, kind, declared type and flags (the YAML alone does not show a schema's types)."""
        if isinstance(node, DictConfig):
            own = [(path, "dict", str(node._metadata.object_type), str(node._get_flag("struct")))]
            return own + [n for key in node.keys() for n in nodes(node._get_node(key), f"{path}.{key}")]
        if isinstance(node, ListConfig):
            return [(path, "list")] + [n for i in range(len(node)) for n in nodes(node._get_node(i), f"{path}[{i}]")]
        return [(path, type(node).__name__, str(node._metadata.ref_type))]

    base, values = _split_values(overrides)
    assert values and len(base) + len(values) == len(overrides)  # the case takes the kept defaults list's path
    compose(overrides)  # the defaults list is kept now: the next compose copies it
    split, whole = compose(overrides), _hydra_compose(overrides, "config")
    assert OmegaConf.to_yaml(split) == OmegaConf.to_yaml(whole)
    assert nodes(split) == nodes(whole)


@pytest.mark.parametrize("overrides", SPLIT_ERRORS, ids=["option", "key", "type", "syntax"])
def test_compose_errors_are_hydras(overrides: list[str]) -> None:
    from trainer.config.compose import _hydra_compose

    with pytest.raises(Exception) as split:
        compose(["trainer.devices=1", *overrides])
    with pytest.raises(Exception) as whole:
        _hydra_compose(["trainer.devices=1", *overrides], "config")
    assert (type(split.value), str(split.value)) == (type(whole.value), str(whole.value))


def test_a_kept_defaults_list_follows_the_config_files_and_the_store(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An edited YAML file or an option stored again in the ConfigStore is composed anew."""
    import importlib
    import shutil

    from hydra.core.config_store import ConfigStore

    from trainer.data import StdlibDataConfig

    compose_module = importlib.import_module("trainer.config.compose")
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    monkeypatch.setattr(compose_module, "CONF_DIR", conf)
    assert compose(["model=tiny", "trainer.max_steps=2"]).model.dim == compose(["model=tiny"]).model.dim
    tiny = conf / "model" / "tiny.yaml"
    text = tiny.read_text()
    assert "\ndim: " in text
    tiny.write_text(text.replace("\ndim: ", "\ndim: 1000 #", 1))
    assert compose(["model=tiny", "trainer.max_steps=2"]).model.dim == 1000
    # the same schema stored again under a default that differs
    store = ConfigStore.instance()
    before = compose(["trainer.max_steps=2"]).data.max_bytes
    assert before != 12345
    store.store(group="data", name="stdlib_schema", node=StdlibDataConfig(max_bytes=12345))
    try:
        assert compose(["trainer.max_steps=2"]).data.max_bytes == 12345
    finally:
        store.store(group="data", name="stdlib_schema", node=StdlibDataConfig)
    assert compose(["trainer.max_steps=2"]).data.max_bytes == before


def test_every_group_has_options() -> None:
    for group in GROUPS:
        assert group_options(group), f"conf/{group} is empty"


@pytest.mark.parametrize(("group", "option"), all_options())
def test_every_option_composes_and_instantiates(group: str, option: str, token_dir: Path,
                                                tmp_path: Path) -> None:
    overrides = [f"{group}={option}"] + OPTION_NEEDS.get((group, option), [])
    if group == "data":
        overrides += data_sources(option, token_dir, tmp_path)
    cfg = compose(overrides)
    node = cfg[group]
    if group == "model":
        model = build_meta_model(OmegaConf.to_object(node))
        assert model.num_params() > 0
        # the model's own checks run in validation; big models only need to fit their own max_seq_len
        validate(compose(overrides + [f"trainer.seq_len={min(256, node.max_seq_len)}"]))
        return
    validate(cfg)
    if group == "data":
        source = instantiate(source_config(node))  # the node less the loop's options (document_masking)
        for one in getattr(source, "sources", [source]):  # a mixture's sources
            assert len(one.train_tokens()) > 0 and len(one.val_tokens()) > 0
    elif group == "optimizer":
        optimizer = optimizer_from_config(node, [torch.nn.Linear(4, 4)])
        assert optimizer.param_groups[0]["lr"] == node.lr
    elif group == "lr_schedule":
        schedule = instantiate(node)(total_steps=total_steps(cfg))
        assert 0.0 < schedule(total_steps(cfg) // 2) <= 1.0
    elif group == "logger":
        for name, logger_node in node.items():
            if name == "wandb":
                continue  # starts a wandb service; covered end to end in test_run.py
            assert instantiate(logger_node)(run_dir=tmp_path) is not None
    elif group == "callbacks":
        for callback_node in node.values():
            assert instantiate(callback_node) is not None
    else:
        assert instantiate(node) is not None


# (overrides, substring the one-line message must contain)
INVALID = [
    (["trainer.max_stepz=5"], "trainer.max_stepz: unknown key; did you mean 'max_steps'?"),
    (["trainer.max_steps=abc"], "trainer.max_steps:"),
    (["model=nope"], "model=nope: no such option; available: deepseek_v3_671b, deepseek_v3_tiny, gpt2_small"),
    (["strategy=nope"], "strategy=nope: no such option; available: 3d, ddp, fsdp, pp, single, tp, zero1, zero2, zero3"),
    (["trainer.global_batch_size=20"], "trainer.global_batch_size: 20 is not a multiple of"),
    (["trainer.seq_len=1024"], "trainer.seq_len: 1024 exceeds model.max_seq_len=512"),
    (["tp=2"], "tp=2 needs tensor parallelism: pick strategy=tp or strategy=3d"),
    (["pp=2"], "pp=2 needs pipeline parallelism: pick strategy=pp or strategy=3d"),
    (["dp=2"], "dp=2 needs data parallelism: pick strategy=ddp"),
    (["trainer.devices=2"], "trainer.devices: trainer.devices x trainer.num_nodes = 2 processes"),
    (["mode=fly"], "mode: 'fly' is not one of train"),
    (["model.n_heads=7"], "model:"),
    (["model.n_kv_heads=3"], "model:"),
    (["optimizer.lr=-1"], "optimizer.lr: must be positive"),
    (["lr_schedule=wsd", "lr_schedule.decay_fraction=0"], "lr_schedule: decay_fraction must be in (0.0, 1.0], got 0"),
    (["trainer.max_steps=null"], "trainer.max_steps: set trainer.max_steps or trainer.max_tokens"),
    (["trainer.micro_batch_size=0"], "trainer.micro_batch_size: must be >= 1"),
    (["trainer.accelerator=tpu"], "trainer.accelerator: 'tpu' is not one of auto, cpu, cuda"),
    (["trainer.grad_clip=-1"], "trainer.grad_clip: must be >= 0"),
    (["lr_schedule.min_ratio=2"], "lr_schedule: min_ratio"),
    (["data=token_file"], "data.path: required value is missing"),
    (["trainer.val_every=-1"], "trainer.val_every: must be >= 0"),
    (["model=gpt2_small", "model.attn_impl=flash"], "model:"),
    (["logger=nope"], "logger=nope: no such option; available: csv, tensorboard, wandb"),
    (["trainer.max_steps=[1,2"], "cannot parse override"),
    (["+trainer.extra=1"], "trainer.extra: unknown key"),
    (["optimizer.betaz=[0.9,0.9]"], "optimizer.betaz: unknown key; did you mean 'betas'?"),
    (["strategy=ddp", "trainer.devices=4", "dp=2"],
     "dp: dp x tp x pp x cp = 2 x 1 x 1 x 1 = 2 does not match trainer.devices x trainer.num_nodes = 4 x 1 = 4"),
    (["strategy=ddp", "trainer.devices=2", "strategy.offload_params=true"],
     "strategy: strategy=ddp cannot offload parameters: every rank keeps the whole model"),
    (["strategy=ddp", "trainer.devices=2", "strategy.offload_optimizer=true"],
     "strategy: strategy=ddp cannot offload the optimizer: every rank holds all of its states"),
    (["strategy=zero1", "trainer.devices=2", "strategy.offload_params=true"], "strategy=zero1 cannot offload parameters"),
    (["strategy=zero2", "trainer.devices=2", "strategy.offload_params=true"],
     "strategy: strategy=zero2 keeps the parameters on every rank's device by definition"),
    (["strategy=fsdp", "strategy.sharding=hybrid_shard", "trainer.devices=3", "trainer.global_batch_size=24"],
     "strategy: hybrid_shard needs dp = dp_replicate x dp_shard with both >= 2; dp=3"),
    (["strategy=fsdp", "strategy.sharding=hybrid_shard", "strategy.dp_replicate=3", "trainer.devices=4"],
     "dp=4 and dp_replicate=3 do not factor"),
    (["strategy=fsdp", "strategy.sharding=zero_infinity", "trainer.devices=2"],
     "strategy: sharding must be one of full_shard, shard_grad_op, hybrid_shard"),
    (["strategy=ddp", "strategy.comm_hook=int8", "trainer.devices=2"], "comm_hook must be one of none, bf16"),
    (["strategy=ddp", "strategy.comm_hook=bf16", "trainer.devices=2", "trainer.accelerator=cpu"],
     "strategy: comm_hook=bf16 needs CUDA with NCCL >= 2.10"),
    (["strategy=ddp", "trainer.devices=2", "trainer.num_nodes=2"], "trainer.rdzv_endpoint: a multi-node run"),
    (["strategy=ddp", "trainer.devices=4", "trainer.global_batch_size=12"],
     "trainer.global_batch_size: 12 is not a multiple of trainer.micro_batch_size x data-parallel size = 8 x 4"),
    # tensor parallelism (plugins/strategies/tensor_parallel.py)
    (["strategy=tp", "tp=3", "trainer.devices=3", "model=llama2_7b"],
     "tp: cannot split model llama2_7b over tp=3 ranks: model.n_heads=32 (query heads) is not divisible by tp=3"),
    (["strategy=tp"], "tp: strategy=tp needs tp >= 2 (tp=1 splits nothing): e.g. tp=2 trainer.devices=2"),
    (["strategy=tp", "tp=4", "trainer.devices=4", "model.n_kv_heads=2"],
     "tp: cannot split model tiny over tp=4 ranks: model.n_kv_heads=2 (key/value heads) is not divisible by tp=4"),
    (["strategy=tp", "tp=2", "trainer.devices=2", "model=gpt2_small"],
     "tp: cannot split model gpt2_small over tp=2 ranks: model.vocab_size=50257 (vocabulary rows) is not divisible "
     "by tp=2 (pad it: model.vocab_size=50432, a multiple of 128 x tp)"),
    (["strategy=tp", "tp=2", "trainer.devices=4"], "strategy=tp has no data parallelism, so tp x pp x cp = 2 x 1 x 1 = 2"),
    # pipeline parallelism (plugins/strategies/pipeline.py)
    (["strategy=pp"], "strategy: strategy=pp needs pp >= 2 pipeline stages, got pp=1: set pp=2 trainer.devices=2"),
    (["strategy=pp", "pp=8", "trainer.devices=8"],
     "strategy: pp=8 is more than the model's 4 layers: every pipeline stage needs at least one transformer block"),
    (["strategy=pp", "pp=4", "trainer.devices=4"],
     "strategy: micro-batches per step = trainer.global_batch_size / (trainer.micro_batch_size x dp) = 2, fewer "
     "than the pp=4 pipeline stages"),
    (["strategy=pp", "pp=2", "trainer.devices=2", "strategy.schedule=interleaved_1f1b", "strategy.virtual_stages=4"],
     "strategy: pp x strategy.virtual_stages = 2 x 4 = 8 stages need at least 8 layers, the model has 4"),
    (["strategy=pp", "pp=2", "trainer.devices=2", "strategy.virtual_stages=2"],
     "strategy: schedule=1f1b runs one stage per rank; virtual_stages=2 needs schedule=interleaved_1f1b or "
     "zero_bubble"),
    (["strategy=pp", "pp=2", "trainer.devices=2", "strategy.schedule=interleaved_1f1b",
      "trainer.global_batch_size=10", "trainer.micro_batch_size=2"],
     "strategy: micro-batches per step = trainer.global_batch_size / (trainer.micro_batch_size x dp) = 5, but "
     "schedule=interleaved_1f1b runs them in max(1, M // pp) = 2 rounds"),
    (["strategy=pp", "pp=2", "trainer.devices=2", "strategy.layers_per_stage=[1,2]"],
     "strategy: layers_per_stage=[1, 2] sums to 3, but the model has 4 layers"),
    (["strategy=pp", "pp=2", "trainer.devices=2", "strategy.schedule=zero_bubble", "strategy.virtual_stages=2",
      "trainer.compile=true"], "strategy: schedule=zero_bubble splits each backward"),
    (["strategy=pp", "pp=2", "trainer.devices=2", "strategy.schedule=zbv"],
     "strategy: schedule=zbv places exactly 2 stages per rank in a V (rank r holds stages r and 2 pp - 1 - r): "
     "set strategy.virtual_stages=2, got 1"),
    (["strategy=pp", "pp=2", "trainer.devices=2", "strategy.schedule=dualpipev", "strategy.virtual_stages=2"],
     "strategy: micro-batches per step = trainer.global_batch_size / (trainer.micro_batch_size x dp) = 2, but "
     "schedule=dualpipev needs at least as many as its 2 x pp = 4 stages"),
    (["strategy=pp", "pp=2", "trainer.devices=2", "strategy.schedule=dualpipe"],
     "strategy: schedule must be one of gpipe, 1f1b, interleaved_1f1b, zero_bubble"),
    (["model=llama2_7b", "strategy=3d", "tp=3", "pp=2", "trainer.devices=12", "trainer.micro_batch_size=2"],
     "tp: cannot split model llama2_7b over tp=3 ranks: model.n_heads=32 (query heads) is not divisible by tp=3"),
    (["cp=2"], "cp: cp=2 needs context parallelism over several processes: pick strategy=ddp"),
    (["strategy=ddp", "cp=3", "trainer.devices=3"],
     "trainer.seq_len: 256 cannot be cut into 2 x cp = 6 chunks (ring attention's causal load balancing"),
    (["strategy=ddp", "cp=3", "trainer.devices=3", "cp_method=all_to_all"],
     "trainer.seq_len: 256 cannot be cut into cp = 3 contiguous shards: pick a multiple of 3"),
    (["strategy=ddp", "cp=2", "trainer.devices=2", "cp_method=all_to_all", "model.n_heads=2", "model.n_kv_heads=1",
      "tp=1", "strategy=3d", "tp=2", "trainer.devices=4"],
     "cp: cp_method=all_to_all gives each cp rank n_heads / (tp x cp) query heads, but model.n_heads=2 is not "
     "divisible by tp x cp = 2 x 2"),
    (["strategy=ddp", "cp=2", "trainer.devices=2", "cp_method=ulysses"], "cp_method: 'ulysses' is not one of ring, all_to_all"),
    (["strategy=zero3", "cp=2", "trainer.devices=6", "dp=2"],
     "dp: dp x tp x pp x cp = 2 x 1 x 1 x 2 = 4 does not match trainer.devices x trainer.num_nodes = 6 x 1 = 6"),
    (["strategy=tp", "tp=2", "cp=2", "trainer.devices=2"],
     "strategy=tp has no data parallelism, so tp x pp x cp = 2 x 1 x 2 = 4 must equal"),
    (["strategy=3d", "tp=2", "pp=2", "dp=3", "trainer.devices=8"],
     "dp: dp x tp x pp x cp = 3 x 2 x 2 x 1 = 12 does not match trainer.devices x trainer.num_nodes = 8 x 1 = 8"),
    (["strategy=3d", "tp=2", "pp=2", "trainer.devices=8", "strategy.data_parallel=zero5"],
     "strategy: data_parallel must be one of ddp, zero1, shard_grad_op, zero3, fsdp, hybrid_shard"),
    (["strategy=3d", "tp=2", "pp=2", "trainer.devices=8", "strategy.data_parallel=zero2"],
     "strategy: data_parallel=zero2 (textbook ZeRO-2, replicated parameters) is not available under 3d; "
     "data_parallel=shard_grad_op is FSDP2's variant"),
    (["strategy=3d", "tp=2", "pp=2", "trainer.devices=8"],
     "strategy: micro-batches per step = trainer.global_batch_size / (trainer.micro_batch_size x dp) = 1, fewer "
     "than the pp=2 pipeline stages"),
]


@pytest.mark.parametrize(("overrides", "expected"), INVALID, ids=[" ".join(o) for o, _ in INVALID])
def test_invalid_config_has_one_clear_line(overrides: list[str], expected: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        preflight(overrides)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert expected in lines[0], lines[0]


@pytest.mark.parametrize("schedule", ["zero_bubble", "zbv", "dualpipev"])
def test_split_backward_schedules_pass_validation_with_every_3d_data_parallel_flavour(schedule: str) -> None:
    """pp=2 x dp=2 (and x ep=2, which borrows the data-parallel ranks): the parity runs of tests/test_pipeline.py
    and tests/test_moe.py cover zero1, zero3 and fsdp (and ddp with the MoE); a refusal here would be a regression."""
    for data_parallel in ("ddp", "zero1", "shard_grad_op", "zero3", "fsdp"):
        for extra in ([], ["model=tiny_moe", "ep=2"]):
            validate(compose(["strategy=3d", "pp=2", "trainer.devices=4", f"strategy.schedule={schedule}",
                              "strategy.virtual_stages=2", "model.n_layers=4", "trainer.global_batch_size=16",
                              "trainer.micro_batch_size=2", f"strategy.data_parallel={data_parallel}", *extra]))


def test_at_least_fifteen_invalid_configs() -> None:
    assert len(INVALID) >= 15


def test_default_config_is_valid_and_documented() -> None:
    cfg = compose([])
    validate(cfg)
    assert cfg.model.name == "tiny" and cfg.strategy._target_.endswith("SingleDevice")
    assert (CONF_DIR / "config.yaml").read_text().startswith("#")
