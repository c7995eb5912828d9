"""Emitted engine configs are checked by the engines' own parsers, not by re-reading our own dicts:
DeepSpeedConfig parses every valid setup's JSON; TrainingArguments (and its DeepSpeed bridge) accepts the kwargs;
accelerate's launcher turns the YAML into the environment its plugins read; the FSDP2 module trains a real step."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from memfit import emit
from memfit.emit.emitted import uses_fsdp
from memfit.errors import ConfigError
from memfit.hardware import make_hardware
from memfit.setup import Attention, Checkpointing, Offload, Optimizer, Precision, Sharding, TrainingSetup

from tiny_configs import TINY_LLAMA

HARDWARE = make_hardware("H100", gpus_per_node=8, num_nodes=2)
DS_OWNED = (Optimizer.ADAMW, Optimizer.ADAMW_FOREACH, Optimizer.ADAMW_FUSED)


def _all_valid() -> list[TrainingSetup]:
    setups = []
    for precision, optimizer, checkpointing, sharding, offload, num_gpus in itertools.product(
            Precision, Optimizer, Checkpointing, Sharding, Offload, (1, 2, 8)):
        try:
            setups.append(TrainingSetup(micro_batch_size=2, grad_accum_steps=3, precision=precision,
                                        optimizer=optimizer, checkpointing=checkpointing, sharding=sharding,
                                        offload=offload, num_gpus=num_gpus))
        except ConfigError:  # TrainingSetup rejects the impossible combinations itself
            continue
    return setups


def _representative() -> list[TrainingSetup]:
    """Every precision with every sharding stage and offload; optimizer, checkpointing, attention, batch sizes and
    GPU counts rotate so each value appears several times."""
    setups: list[TrainingSetup] = []
    for precision, sharding, offload in itertools.product(Precision, Sharding, Offload):
        k = len(setups)
        num_gpus = (1 if k % 3 == 0 else 2 if k % 2 else 8) if sharding is Sharding.NONE else (2 if k % 2 else 8)
        for shift in range(len(Optimizer)):  # the next optimizer in turn that the combination allows
            try:
                setup = TrainingSetup(micro_batch_size=1 + k % 4, grad_accum_steps=1 + k % 3, seq_len=128,
                                      precision=precision, optimizer=list(Optimizer)[(k + shift) % len(Optimizer)],
                                      checkpointing=list(Checkpointing)[k % len(Checkpointing)],
                                      attention=list(Attention)[k // 2 % 2],
                                      sharding=sharding, offload=offload, num_gpus=num_gpus)
            except ConfigError:
                continue
            if not (emit.uses_deepspeed(setup) and _deepspeed_refuses(setup)):
                setups.append(setup)
                break
    covered = {s.optimizer for s in setups}
    setups += [TrainingSetup(micro_batch_size=2, seq_len=128, optimizer=o) for o in Optimizer if o not in covered]
    return setups


def _deepspeed_refuses(setup: TrainingSetup) -> bool:
    """The documented cases: pure bf16 needs ZeRO, and offloaded bf16 states need DeepSpeed's CPU Adam."""
    if setup.precision is not Precision.BF16:
        return False
    return emit.zero_stage(setup) == 0 or (setup.offload is not Offload.NONE and setup.optimizer not in DS_OWNED)


ALL_VALID = _all_valid()
REPRESENTATIVE = _representative()
FSDP_CAPABLE = [s for s in REPRESENTATIVE if not emit.fsdp2_unsupported(s)]


def _id(setup: TrainingSetup) -> str:
    return (f"{setup.precision}-{setup.optimizer}-{setup.sharding}-off_{setup.offload}-ck_{setup.checkpointing}"
            f"-{setup.num_gpus}gpu")


def test_matrix_covers_every_value():
    for axis, values in (("precision", Precision), ("optimizer", Optimizer), ("sharding", Sharding),
                         ("offload", Offload), ("checkpointing", Checkpointing), ("attention", Attention)):
        assert {getattr(s, axis) for s in REPRESENTATIVE} == set(values), axis
    assert len(FSDP_CAPABLE) >= 6


@pytest.mark.processes
def test_emit_imports_no_engine():
    code = ("import sys, memfit.emit; "
            "print([m for m in ('torch', 'transformers', 'deepspeed', 'accelerate') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------- DeepSpeed


def _engines(*names: str) -> None:
    """Skip where an engine is not installed; the pure tests in this file run without any of them."""
    for name in names:
        pytest.importorskip(name)


@pytest.fixture
def deepspeed_world(monkeypatch):
    """DeepSpeedConfig reads the world size from deepspeed.comm; fake it instead of starting N processes."""
    _engines("torch", "deepspeed")
    import deepspeed.comm as ds_comm

    def set_world(num_ranks: int) -> None:
        monkeypatch.setattr(ds_comm, "get_rank", lambda *args, **kwargs: 0)
        monkeypatch.setattr(ds_comm, "get_world_size", lambda *args, **kwargs: num_ranks)

    return set_world


@pytest.mark.parametrize("precision", list(Precision), ids=str)
def test_deepspeed_parses_every_valid_setup(precision, deepspeed_world):
    from deepspeed.runtime.config import DeepSpeedConfig

    checked = 0
    for setup in (s for s in ALL_VALID if s.precision is precision):
        if _deepspeed_refuses(setup):
            with pytest.raises(ConfigError, match="deepspeed|DeepSpeed|bf16"):
                emit.deepspeed_config(setup)
            continue
        deepspeed_world(setup.num_gpus)
        parsed = DeepSpeedConfig(emit.deepspeed_config(setup), mpu=None)
        _check_parsed(parsed, setup)
        checked += 1
    assert checked > 100


def _check_parsed(parsed, setup: TrainingSetup) -> None:
    assert parsed.world_size == setup.num_gpus
    assert parsed.train_micro_batch_size_per_gpu == setup.micro_batch_size
    assert parsed.gradient_accumulation_steps == setup.grad_accum_steps
    assert parsed.train_batch_size == setup.effective_batch_size
    assert parsed.gradient_clipping == 1.0
    stage = setup.sharding.stage or (1 if setup.offload is not Offload.NONE else 0)
    assert parsed.zero_optimization_stage == stage
    offload = parsed.zero_config.offload_optimizer
    assert (offload.device if offload else "none") == ("cpu" if setup.offload is not Offload.NONE else "none")
    params = parsed.zero_config.offload_param
    assert (params.device if params else "none") == ("cpu" if setup.offload is Offload.OPTIMIZER_AND_PARAMS else "none")
    bf16 = parsed.bfloat16_config
    assert bf16.enabled == (setup.precision in (Precision.BF16, Precision.BF16_MASTER, Precision.AMP_BF16))
    assert bf16.bf16_master_weights_and_grads == bf16.bf16_optimizer_states == (setup.precision is Precision.BF16)
    assert parsed.float16_config.enabled == (setup.precision is Precision.AMP_FP16)
    if setup.precision is Precision.AMP_FP16:
        assert parsed.float16_config.loss_scale == 0  # dynamic
    if setup.optimizer in DS_OWNED:
        assert parsed.optimizer_name == "adamw"
        assert parsed.optimizer_params.get("torch_adam", False) == (setup.offload is Offload.NONE)
    else:
        assert parsed.optimizer_name is None
        assert parsed.zero_allow_untested_optimizer == (stage > 0)
        assert parsed.zero_force_ds_cpu_optimizer == (setup.offload is Offload.NONE)


def test_deepspeed_hf_flavour_leaves_trainer_values_auto():
    setup = TrainingSetup(precision="bf16-master", optimizer="adamw", sharding="zero2", num_gpus=4)
    config = emit.deepspeed_config(setup, hf_auto=True)
    assert config["train_batch_size"] == config["gradient_clipping"] == "auto"
    assert config["optimizer"]["params"] == {"torch_adam": True, "foreach": False, "lr": "auto", "betas": "auto",
                                             "eps": "auto", "weight_decay": "auto"}
    assert config["train_micro_batch_size_per_gpu"] == setup.micro_batch_size  # memory-defining values stay explicit


# ---------------------------------------------------------------- HF Trainer


@pytest.mark.parametrize("setup", REPRESENTATIVE, ids=_id)
def test_training_arguments_accept_kwargs(setup, tmp_path, isolated_accelerate, deepspeed_world):
    _engines("transformers", "accelerate")
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import TrainingArguments

    ds_path = tmp_path / "deepspeed.json"
    if emit.uses_deepspeed(setup):
        ds_path.write_text(emit.deepspeed_file(setup).render())
    kwargs = emit.hf_trainer_kwargs(setup, deepspeed_path=str(ds_path))
    # use_cpu: there is no GPU here; it only skips TrainingArguments' "bf16 needs a GPU" check and device setup.
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", **kwargs)
    assert args.per_device_train_batch_size == setup.micro_batch_size
    assert args.gradient_accumulation_steps == setup.grad_accum_steps
    assert args.optim.value == kwargs["optim"]
    assert args.activation_checkpointing == (setup.checkpointing is Checkpointing.FULL)
    assert args.fp16 == (setup.precision is Precision.AMP_FP16)
    if not emit.uses_deepspeed(setup):
        assert args.deepspeed is None
        return
    # The Trainer's DeepSpeed bridge fills the "auto" values and records every mismatch with TrainingArguments.
    hf_config = args.hf_deepspeed_config
    assert hf_config.mismatches == []
    assert args.deepspeed_plugin.zero_stage == emit.zero_stage(setup)
    deepspeed_world(1)  # TrainingArguments computed train_batch_size for its own world of one process
    parsed = DeepSpeedConfig(hf_config.config)
    assert parsed.zero_optimization_stage == emit.zero_stage(setup)
    assert parsed.train_micro_batch_size_per_gpu == setup.micro_batch_size
    assert parsed.bfloat16_config.enabled == args.bf16


def test_training_args_json_parses_with_hf_argument_parser(tmp_path, isolated_accelerate):
    _engines("torch", "transformers", "accelerate")
    from transformers import HfArgumentParser, TrainingArguments

    setup = TrainingSetup(micro_batch_size=3, grad_accum_steps=4, precision="amp-bf16", optimizer="sgd",
                          checkpointing="full")
    path = tmp_path / "training_args.json"
    path.write_text(emit.hf_trainer_file(setup).render())
    content = json.loads(path.read_text())
    (args,) = HfArgumentParser(TrainingArguments).parse_dict({**content, "use_cpu": True})
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (3, 4)
    assert args.optim_args == "momentum=0.9" and args.activation_checkpointing_kwargs == {"use_reentrant": False}


def test_legacy_checkpointing_names():
    setup = TrainingSetup(checkpointing="full")
    kwargs = emit.hf_trainer_kwargs(setup, legacy_names=True)
    assert kwargs["gradient_checkpointing"] is True and "activation_checkpointing" not in kwargs


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """The shared tiny Llama config, saved once with random weights so from_pretrained has something to load."""
    _engines("torch", "transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    directory = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("precision,attention", [("bf16", "sdpa"), ("amp-bf16", "eager"), ("fp32", "sdpa")])
def test_model_kwargs_load_a_real_model(precision, attention, tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM

    setup = TrainingSetup(precision=precision, attention=attention)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, **emit.hf_model_kwargs(setup))
    assert model.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
    assert model.config._attn_implementation == attention
    assert model.config.use_cache is False


# ---------------------------------------------------------------- accelerate


def _launch_environment(yaml_path):
    """What `accelerate launch --config_file` would export for the script, via accelerate's own launcher code."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(yaml_path), "train.py"])
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    if args.use_deepspeed:  # as accelerate's launch_command does before calling the DeepSpeed launcher
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_precision_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        return args, prepare_deepspeed_cmd_env(args)[1]
    return args, prepare_multi_gpu_env(args)


def _accelerate_cases():
    cases = [(s, "deepspeed") for s in REPRESENTATIVE] + [(s, "fsdp") for s in FSDP_CAPABLE]
    return pytest.mark.parametrize("setup,backend", cases, ids=[f"{b}-{_id(s)}" for s, b in cases])


@_accelerate_cases()
def test_accelerate_yaml_loaded_and_launched_by_accelerate(setup, backend, tmp_path, monkeypatch):
    _engines("torch", "accelerate", "yaml")
    import yaml
    from accelerate.commands.config.config_args import load_config_from_file

    ds_path = tmp_path / "deepspeed.json"
    ds_path.write_text(json.dumps(emit.deepspeed_config(setup, hf_auto=True)) if emit.uses_deepspeed(setup) else "")
    emitted = emit.accelerate_file(setup, HARDWARE, backend=backend, deepspeed_path=str(ds_path))
    yaml_path = tmp_path / "accelerate.yaml"
    yaml_path.write_text(emitted.render())
    assert yaml.safe_load(yaml_path.read_text()) == emitted.content  # comments are YAML comments only

    config = load_config_from_file(str(yaml_path))
    assert config.num_processes == setup.num_gpus
    assert config.num_machines == -(-setup.num_gpus // HARDWARE.gpus_per_node)
    if uses_fsdp(setup):
        expected_type = "FSDP"  # engine torch: FSDP2 runs it whichever file was asked for
    else:
        expected_type = ("NO" if setup.num_gpus == 1 else "MULTI_GPU") if not emit.uses_deepspeed(setup) else (
            "DEEPSPEED" if backend == "deepspeed" else "FSDP")
    assert config.distributed_type.value == expected_type

    args, env = _launch_environment(yaml_path)
    for key, value in env.items():
        if key.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.setenv(key, value)
    if expected_type == "DEEPSPEED":
        _check_deepspeed_plugin(setup)
    elif expected_type == "FSDP":
        _check_fsdp_plugin(setup)
    else:
        assert env["ACCELERATE_MIXED_PRECISION"] == {"amp-fp16": "fp16", "amp-bf16": "bf16",
                                                     "bf16-master": "bf16"}.get(str(setup.precision), "no")


def _check_deepspeed_plugin(setup: TrainingSetup) -> None:
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin()  # reads the launcher's env; refuses yaml keys that clash with the config file
    assert plugin.zero_stage == emit.zero_stage(setup)
    assert plugin.offload_optimizer_device == ("cpu" if setup.offload is not Offload.NONE else "none")
    assert plugin.offload_param_device == ("cpu" if setup.offload is Offload.OPTIMIZER_AND_PARAMS else "none")
    assert plugin.zero3_init_flag == (setup.sharding is Sharding.ZERO3)


def _check_fsdp_plugin(setup: TrainingSetup) -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is (setup.sharding is Sharding.ZERO3)
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) == (setup.offload is Offload.OPTIMIZER_AND_PARAMS)
    assert plugin.activation_checkpointing == (setup.checkpointing is Checkpointing.FULL)
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"


def test_accelerate_refuses_what_fsdp2_cannot_express():
    zero1 = TrainingSetup(sharding="zero1", num_gpus=2)
    with pytest.raises(ConfigError, match="ZeRO-1"):
        emit.accelerate_config(zero1, HARDWARE, backend="fsdp")
    with pytest.raises(ConfigError, match="hardware has 16"):
        emit.accelerate_config(zero1.replace(num_gpus=32), HARDWARE)


# ---------------------------------------------------------------- FSDP2


@pytest.fixture(scope="module")
def process_group():
    """One-process gloo group: FSDP2 shards over a world of one, which runs the same code paths."""
    _engines("torch")
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    store = tempfile.NamedTemporaryFile(prefix="memfit-pg-", delete=False)
    store.close()
    dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    os.unlink(store.name)


def _tiny_model():
    """Embedding, a ModuleList of blocks, a head: the shape shard_model looks for."""
    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 16)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3))
            self.head = nn.Linear(16, 32)

        def forward(self, ids):
            hidden = self.embed(ids)
            for block in self.blocks:
                hidden = hidden + block(hidden)
            return self.head(hidden).clone()  # FSDP2 warns when a root returns a view

    torch.manual_seed(0)
    return Tiny()


def _load(code: str) -> dict:
    namespace: dict = {}
    exec(compile(code, "fsdp2_shard.py", "exec"), namespace)
    return namespace


def _train_step(namespace: dict, model, loss_of, setup: TrainingSetup):
    import torch

    optimizer = namespace["build_optimizer"](model, 1e-3)
    loss = loss_of(model)
    if setup.precision is Precision.AMP_FP16:
        scaler = namespace["make_grad_scaler"]()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    assert torch.isfinite(loss.detach().float())
    return optimizer


@pytest.mark.parametrize("setup", FSDP_CAPABLE, ids=_id)
@pytest.mark.processes
def test_fsdp2_code_shards_and_trains(setup, process_group):
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    from torch.distributed.tensor import DTensor

    namespace = _load(emit.fsdp2_code(setup))
    model = namespace["shard_model"](_tiny_model())
    assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in model.blocks)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    # FSDP2's own record of the options (private, but the only place they are kept).
    group = model.blocks[0]._get_fsdp_state()._fsdp_param_group
    assert (group.post_forward_mesh_info is not None) == (setup.sharding is Sharding.ZERO3)
    assert isinstance(group.offload_policy, CPUOffloadPolicy) == (setup.offload is Offload.OPTIMIZER_AND_PARAMS)
    checkpointed = type(model.blocks[0]).__name__.endswith("CheckpointWrapper")
    if setup.checkpointing in (Checkpointing.NONE, Checkpointing.FULL):  # selective modes: tests/test_selective_*
        assert checkpointed == (setup.checkpointing is Checkpointing.FULL)

    ids = torch.randint(0, 32, (2, 5))
    optimizer = _train_step(namespace, model, lambda m: m(ids).float().pow(2).mean(), setup)
    compute_dtype = {Precision.FP32: torch.float32, Precision.AMP_FP16: torch.float16}.get(setup.precision,
                                                                                           torch.bfloat16)
    assert model(ids).dtype == compute_dtype
    state_dtype = torch.bfloat16 if setup.precision is Precision.BF16 else torch.float32
    states = [t for s in optimizer.state.values() for k, t in s.items() if k != "step" and torch.is_tensor(t)]
    assert states and all(t.dtype == state_dtype and isinstance(t, DTensor) for t in states)


def test_fsdp2_code_on_a_transformers_model(tiny_llama_dir, process_group):
    import torch
    from transformers import AutoModelForCausalLM

    setup = TrainingSetup(precision="bf16-master", optimizer="adamw-fused", checkpointing="full", sharding="zero3",
                          offload="optimizer+params", num_gpus=2)
    namespace = _load(emit.fsdp2_code(setup))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, **emit.hf_model_kwargs(setup))
    model.train()
    namespace["shard_model"](model)
    assert model.model.layers[0].gradient_checkpointing  # the transformers route, not the wrapper
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 8))
    _train_step(namespace, model, lambda m: m(input_ids=ids, labels=ids).loss, setup)


@pytest.mark.parametrize("changes,match", [
    ({"sharding": "zero1"}, "ZeRO-1"),
    ({"offload": "optimizer"}, "optimizer alone"),
    ({"optimizer": "adamw-8bit"}, "DTensor"),
    ({"optimizer": "adafactor"}, "DTensor"),
    ({"sharding": "none", "num_gpus": 1}, "nothing"),
])
def test_fsdp2_refuses_what_it_cannot_express(changes, match):
    setup = TrainingSetup(sharding="zero2", num_gpus=2).replace(**changes)
    assert match in emit.fsdp2_unsupported(setup)
    with pytest.raises(ConfigError, match=match):
        emit.fsdp2_code(setup)


# ---------------------------------------------------------------- comments and files


@pytest.mark.parametrize("setup", REPRESENTATIVE[::3] + [TrainingSetup(sharding="zero3", num_gpus=16)], ids=_id)
def test_every_setting_has_a_reason(setup, tmp_path):
    files, _ = emit.emitted_files(setup, HARDWARE, tmp_path)
    for emitted in files:
        if not isinstance(emitted.content, dict):
            continue
        keys = set(_dotted_keys(emitted.content))
        assert set(emitted.comments) <= keys, emitted.filename
        boilerplate = ("compute_environment", "machine_rank", "main_training_function", "use_cpu")
        top = {k for k in emitted.content if k not in boilerplate}
        covered = {k.split(".")[0] for k in emitted.comments}
        assert top <= covered, (emitted.filename, top - covered)


def _dotted_keys(data: dict, prefix: str = ""):
    for key, value in data.items():
        yield prefix + key
        if isinstance(value, dict):
            yield from _dotted_keys(value, f"{prefix}{key}.")


def test_write_all_writes_and_protects_user_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    setup = TrainingSetup(precision="bf16-master", sharding="zero3", offload="optimizer+params", num_gpus=8,
                          checkpointing="full")
    out = Path("configs")
    paths = emit.write_all(setup, HARDWARE, out)
    names = {p.name for p in paths}
    assert names == {"training_args.json", "model_kwargs.json", "deepspeed.json", "accelerate.yaml",
                     "accelerate_fsdp2.yaml", "fsdp2_shard.py", "memfit_setup.json", "README.md"}
    readme = (out / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in names - {"README.md"})
    training_args = json.loads((out / "training_args.json").read_text())
    assert training_args["deepspeed"] == "configs/deepspeed.json"  # relative to where memfit ran (and launches)
    compile((out / "fsdp2_shard.py").read_text(), "fsdp2_shard.py", "exec")

    assert emit.write_all(setup, HARDWARE, out) == paths  # memfit's own untouched files are replaced
    (out / "deepspeed.json").write_text("{}\n")  # the user edits one
    with pytest.raises(ConfigError, match="deepspeed.json"):
        emit.write_all(setup, HARDWARE, out)
    emit.write_all(setup, HARDWARE, out, force=True)

    single = TrainingSetup(num_gpus=1)  # no engine needed: the earlier, untouched engine files go away
    names = {p.name for p in emit.write_all(single, HARDWARE, out)}
    assert "deepspeed.json" not in names and not (out / "deepspeed.json").exists()
    assert "not needed" in (out / "README.md").read_text()


def test_emitted_files_name_no_absolute_path_of_this_machine(tmp_path, monkeypatch):
    """Configs are moved between machines: they name each other relative to where memfit ran, and hold no path
    of this machine (home, interpreter, working directory), whether DIR was given relative or absolute."""
    monkeypatch.chdir(tmp_path)
    setup = TrainingSetup(precision="bf16-master", sharding="zero3", offload="optimizer", num_gpus=16,
                          checkpointing="full")
    machine = {str(tmp_path), str(tmp_path.resolve()), str(Path.home()), sys.prefix, sys.executable,
               os.path.dirname(sys.executable)}
    for directory, expected in ((Path("out/rel"), "out/rel/deepspeed.json"),
                                (tmp_path / "abs", "abs/deepspeed.json")):
        paths = emit.write_all(setup, HARDWARE, directory)
        assert {p.name for p in paths} >= {"training_args.json", "deepspeed.json", "accelerate.yaml", "README.md"}
        for path in paths:
            text = path.read_text()
            found = [m for m in machine if m in text]
            assert not found, (path.name, found)
        assert json.loads((directory / "training_args.json").read_text())["deepspeed"] == expected
        assert f'deepspeed_config_file: "{expected}"' in (directory / "accelerate.yaml").read_text()
        assert f"`{expected}`, relative to the directory memfit ran in" in (directory / "README.md").read_text()


def test_config_path_keeps_a_directory_outside_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    assert emit.config_path("configs/", "deepspeed.json") == "configs/deepspeed.json"
    assert emit.config_path(".", "deepspeed.json") == "deepspeed.json"
    assert emit.config_path(tmp_path / "work" / "c", "deepspeed.json") == "c/deepspeed.json"
    assert emit.config_path(tmp_path / "elsewhere", "deepspeed.json") == str(tmp_path / "elsewhere" / "deepspeed.json")


WARNING = "memfit plan: does not fit: needs 99 GiB of 70 GiB usable"


def test_warning_is_stamped_into_every_file_that_can_hold_it(tmp_path):
    setup = TrainingSetup(precision="bf16-master", sharding="zero3", num_gpus=8, checkpointing="full")
    paths = {p.name: p for p in emit.write_all(setup, HARDWARE, tmp_path / "out", warning=WARNING)}
    assert set(paths) == {"training_args.json", "model_kwargs.json", "deepspeed.json", "accelerate.yaml",
                          "accelerate_fsdp2.yaml", "fsdp2_shard.py", "memfit_setup.json", "README.md"}
    for name in ("accelerate.yaml", "accelerate_fsdp2.yaml", "fsdp2_shard.py"):
        assert paths[name].read_text().startswith(f"# WARNING: {WARNING}"), name
    compile(paths["fsdp2_shard.py"].read_text(), "fsdp2_shard.py", "exec")  # still valid Python
    readme = paths["README.md"].read_text()
    assert readme.startswith(f"> **WARNING: {WARNING}**")
    assert json.loads(paths["deepspeed.json"].read_text())[emit.WARNING_KEY] == WARNING
    for name in ("training_args.json", "model_kwargs.json", "memfit_setup.json"):  # their readers refuse unknown keys
        assert emit.WARNING_KEY not in json.loads(paths[name].read_text())
        assert f"- `{name}`: " in readme.split("| File |")[0], name
    files, _ = emit.emitted_files(setup, HARDWARE, tmp_path / "out", warning=WARNING)
    assert set(emit.unmarked_files(files)) == {"training_args.json", "model_kwargs.json", "memfit_setup.json"}
    plain = {p.name: p.read_text() for p in emit.write_all(setup, HARDWARE, tmp_path / "plain")}
    assert not any("WARNING" in text or emit.WARNING_KEY in text for text in plain.values())


def test_engines_accept_the_files_with_the_warning(tmp_path, monkeypatch, isolated_accelerate, deepspeed_world):
    """deepspeed.json with its warning key still parses in DeepSpeedConfig and in TrainingArguments' DeepSpeed
    bridge; training_args.json (no key) in TrainingArguments(**kwargs); both accelerate files in accelerate."""
    _engines("transformers", "accelerate")
    from accelerate.commands.config.config_args import load_config_from_file
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import TrainingArguments

    monkeypatch.chdir(tmp_path)
    setup = TrainingSetup(precision="bf16-master", sharding="zero3", num_gpus=8, checkpointing="full")
    emit.write_all(setup, HARDWARE, Path("out"), warning=WARNING)
    deepspeed_world(setup.num_gpus)
    emitted = json.loads(Path("out/deepspeed.json").read_text())
    assert emitted[emit.WARNING_KEY] == WARNING
    parsed = DeepSpeedConfig(_without_auto(emitted), mpu=None)  # "auto" is the HF Trainer's to fill
    assert parsed.zero_optimization_stage == 3 and parsed.train_batch_size == setup.effective_batch_size
    deepspeed_world(1)
    kwargs = json.loads(Path("out/training_args.json").read_text())
    args = TrainingArguments(output_dir="o", use_cpu=True, report_to="none", **kwargs)
    assert args.hf_deepspeed_config.mismatches == [] and args.deepspeed_plugin.zero_stage == 3
    for name in ("accelerate.yaml", "accelerate_fsdp2.yaml"):
        assert load_config_from_file(f"out/{name}").num_processes == 8


def _without_auto(data: dict) -> dict:
    return {k: _without_auto(v) if isinstance(v, dict) else v for k, v in data.items() if v != "auto"}


@pytest.mark.parametrize("major,name", [(4, "gradient_checkpointing"), (5, "activation_checkpointing"),
                                        (None, "activation_checkpointing")])
def test_checkpointing_is_named_for_the_installed_transformers(major, name, monkeypatch):
    from memfit import libraries

    monkeypatch.setattr(libraries, "transformers_major", lambda: major)
    kwargs = emit.hf_trainer_kwargs(TrainingSetup(checkpointing="full"))
    assert kwargs[name] is True and kwargs[f"{name}_kwargs"] == {"use_reentrant": False}
    other = {"gradient_checkpointing", "activation_checkpointing"} - {name}
    assert not other & set(kwargs)


@pytest.mark.parametrize("version,key", [((4, 45), "torch_dtype"), ((4, 56), "dtype"), ((5, 24), "dtype"),
                                         (None, "dtype")])
def test_pure_bf16_dtype_keyword_is_the_one_the_installed_transformers_reads(version, key, monkeypatch):
    from memfit import libraries

    monkeypatch.setattr(libraries, "transformers_version", lambda: version)
    kwargs = emit.hf_model_kwargs(TrainingSetup(precision="bf16"))
    assert kwargs[key] == "bfloat16" and not {"dtype", "torch_dtype"} - {key} & set(kwargs)


def test_installed_transformers_version_is_read():
    transformers = pytest.importorskip("transformers")
    from memfit import libraries

    assert libraries.transformers_major() == int(transformers.__version__.split(".")[0])
    if libraries.transformers_major() >= 5:
        assert "activation_checkpointing" in emit.hf_trainer_kwargs(TrainingSetup(checkpointing="full"))


def test_write_all_refuses_a_plan_no_engine_can_run(tmp_path):
    setup = TrainingSetup(precision="bf16", optimizer="sgd", sharding="zero2", offload="optimizer", num_gpus=2)
    with pytest.raises(ConfigError, match="cannot write deepspeed.json.*CPU Adam"):
        emit.write_all(setup, HARDWARE, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_write_all_refuses_a_file_path_and_foreign_files(tmp_path):
    setup = TrainingSetup()
    a_file = tmp_path / "plan"
    a_file.write_text("mine")
    with pytest.raises(ConfigError, match="is a file"):
        emit.write_all(setup, HARDWARE, a_file)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "accelerate.yaml").write_text("mine\n")
    with pytest.raises(ConfigError, match="accelerate.yaml"):
        emit.write_all(setup, HARDWARE, tmp_path / "dir")
    assert (tmp_path / "dir" / "accelerate.yaml").read_text() == "mine\n"


# ---------------------------------------------------------------- a real DeepSpeed step (slow: C++ ops compile)


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.parametrize("precision,offload,state_dtype", [
    ("bf16-master", "optimizer", "float32"),  # CPU Adam (built by scripts/build_deepspeed_ops.py, else JIT: minutes)
    ("bf16", "none", "bfloat16"),  # DeepSpeed's CPU shm comm op (likewise; ~35 s JIT)
])
def test_deepspeed_initialize_runs_emitted_config(precision, offload, state_dtype, monkeypatch, process_group):
    _engines("torch", "deepspeed")
    import socket

    import deepspeed
    import torch

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                           WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)
    setup = TrainingSetup(micro_batch_size=2, precision=precision, optimizer="adamw", sharding="zero2",
                          offload=offload, num_gpus=2)
    config = emit.deepspeed_config(setup)
    config["train_batch_size"] = setup.micro_batch_size * setup.grad_accum_steps  # one real rank, not two
    config["optimizer"]["params"]["lr"] = 1e-3
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the one-process group the fixture owns
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(torch.randn(2, 16, dtype=torch.bfloat16)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    inner = optimizer.optimizer
    assert type(inner).__name__ == ("DeepSpeedCPUAdam" if offload == "optimizer" else "AdamW")
    states = [t for s in inner.state.values() for k, t in s.items() if k.startswith("exp_avg")]
    assert states and all(t.dtype == getattr(torch, state_dtype) for t in states)


@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_torch_engine_plans_become_fsdp2_trainer_arguments(sharding, tmp_path):
    from transformers import TrainingArguments

    setup = TrainingSetup(sharding=sharding, num_gpus=2, engine="torch", precision="bf16-master")
    kwargs = emit.hf_trainer_kwargs(setup)
    assert "deepspeed" not in kwargs
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **kwargs)
    assert args.fsdp and args.fsdp_config["version"] == 2
    assert args.fsdp_config["reshard_after_forward"] is (sharding == "zero3")
