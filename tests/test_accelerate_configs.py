"""Every file in accelerate_configs/ loads with accelerate's own loader and launcher, says what its header says,
keeps the GPUs that CUDA_VISIBLE_DEVICES selects, and prepares a tiny dense and a tiny MoE model on CPU."""

import json
import os
import sys
import time
from pathlib import Path

import processes
import pytest
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env
from zero3_config import assert_none_resident

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "accelerate_configs"

# file -> (distributed type, ZeRO stage or None, processes, machines)
EXPECTED = {
    "single_gpu.yaml": ("NO", None, 1, 1),
    "multi_gpu.yaml": ("MULTI_GPU", None, 8, 1),
    "zero2.yaml": ("DEEPSPEED", 2, 8, 1),
    "zero3.yaml": ("DEEPSPEED", 3, 8, 1),
    "zero3_moe.yaml": ("DEEPSPEED", 3, 8, 1),
    "zero3_offload.yaml": ("DEEPSPEED", 3, 8, 1),
    "fsdp2.yaml": ("FSDP", None, 8, 1),
    "multi_node_zero3.yaml": ("DEEPSPEED", 3, 32, 4),
}


def _launch_args(name, *overrides):
    parser = launch_command_parser()
    args = parser.parse_args(["--config_file", str(CONFIG_DIR / name), *overrides, "train.py"])
    return _validate_launch_command(args)[0], {action.dest for action in parser._actions}


def launcher_env(name, *overrides) -> dict:
    """The environment `accelerate launch --config_file <name> <overrides>` gives the training processes, computed by
    accelerate's own code: the same dispatch as `accelerate.commands.launch.launch_command`, without the launch."""
    args = launch_command_parser().parse_args(["--config_file", str(CONFIG_DIR / name), *overrides, "train.py"])
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_precision_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        return prepare_deepspeed_cmd_env(args)[1]
    if args.use_fsdp or args.multi_gpu:
        return prepare_multi_gpu_env(args)
    return prepare_simple_launcher_cmd_env(args)[1]


def test_the_directory_holds_exactly_the_documented_files():
    assert sorted(path.name for path in CONFIG_DIR.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_with_accelerate(name):
    distributed_type, stage, processes, machines = EXPECTED[name]
    config = load_config_from_file(str(CONFIG_DIR / name))
    assert isinstance(config, ClusterConfig)
    assert config.distributed_type == distributed_type
    assert config.mixed_precision == "bf16" and config.use_cpu is False
    assert (config.num_processes, config.num_machines) == (processes, machines)
    header = (CONFIG_DIR / name).read_text().splitlines()[0]
    assert header.startswith("# "), f"{name} lacks its header comment"
    if stage is None:
        assert config.deepspeed_config == {}
    else:
        assert config.deepspeed_config["zero_stage"] == stage
        # ZeRO-3 builds the model sharded and saves a loadable bf16 checkpoint; ZeRO-2 must not try zero.Init
        assert config.deepspeed_config["zero3_init_flag"] is (stage == 3)
        assert config.deepspeed_config.get("zero3_save_16bit_model", False) is (stage == 3)
        offload = "cpu" if name == "zero3_offload.yaml" else "none"
        assert config.deepspeed_config["offload_optimizer_device"] == offload
    if name == "fsdp2.yaml":
        assert config.fsdp_config["fsdp_version"] == 2


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_nested_key_is_a_launcher_option(name):
    """Nested keys are passed to `accelerate launch` as options: a typo would be dropped silently."""
    config = load_config_from_file(str(CONFIG_DIR / name))
    _, options = _launch_args(name)
    for key in config.deepspeed_config:
        assert key in options or f"deepspeed_{key}" in options or key == "deepspeed_multinode_launcher", key
    for key in config.fsdp_config:
        assert key in options, key


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_only_the_moe_only_config_names_an_moe_class(name):
    """accelerate raises for a model without the named class, so a config meant for dense models must name none."""
    args, _ = _launch_args(name)
    expected = "Qwen3MoeSparseMoeBlock" if name == "zero3_moe.yaml" else None
    assert getattr(args, "deepspeed_moe_layer_cls_names", None) == expected


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_launcher_keeps_the_gpus_cuda_visible_devices_selects(name, monkeypatch):
    """`CUDA_VISIBLE_DEVICES=4,5 accelerate launch ...` must train on GPUs 4 and 5: a `gpu_ids` other than `all`
    makes accelerate overwrite the variable (single_gpu.yaml with gpu_ids '0' trained on GPU 0, the vLLM GPU)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    env = launcher_env(name, "--num_machines", "1", "--machine_rank", "0", "--main_process_port", "29512")
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5"


def test_multi_node_values_come_from_the_command_line():
    """What the SLURM script passes on each node ($NODE_RANK, $MASTER_ADDR, ...) overrides the placeholders."""
    args, _ = _launch_args(
        "multi_node_zero3.yaml", "--machine_rank", "3", "--main_process_ip", "10.1.2.3", "--main_process_port", "6001",
        "--num_machines", "3", "--num_processes", "24",
    )  # fmt: skip
    assert (args.machine_rank, args.main_process_ip, args.main_process_port) == (3, "10.1.2.3", 6001)
    assert (args.num_machines, args.num_processes) == (3, 24)
    defaults, _ = _launch_args("multi_node_zero3.yaml")
    assert (defaults.machine_rank, defaults.num_machines, defaults.num_processes) == (0, 4, 32)


# ------------------------------------------------------------------ prepare a dense and an MoE model on CPU
def _build_directory(op: str) -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(op, verbose=False))


def _cpu_adam_is_built() -> bool:
    """CPU optimizer offload runs DeepSpeedCPUAdam, a C++ op that DeepSpeed compiles on first use (~8 min here)."""
    return (_build_directory("cpu_adam") / "cpu_adam.so").exists()


def stale_extension_locks(ops=("cpu_adam",), older_than_s=1800) -> list:
    """torch loads a JIT-built op under a `lock` file in its build directory and waits on that file forever. A process
    killed while loading leaves it behind, and every later load hangs (CI once spent 600 s waiting on one). No build
    of these ops takes 30 minutes here, so an older lock is stale. (The one other op DeepSpeed's CPU accelerator
    builds, its shared-memory all-reduce, is off in the child: see dhpo_trl.demo.tiny.use_deepspeed_on_cpu.)"""
    locks = [_build_directory(op) / "lock" for op in ops]
    return [lock for lock in locks if lock.exists() and time.time() - lock.stat().st_mtime > older_than_s]


def _prepare(names) -> dict:
    overrides = ("--num_processes", "1", "--num_machines", "1", "--machine_rank", "0", "--main_process_port", "29513")
    cases = []
    for name in names:
        env = launcher_env(name, *overrides)
        env = {key: value for key, value in env.items() if key.startswith(("ACCELERATE_", "FSDP_"))}
        cases.append({"name": name, "env": env, "cpu": EXPECTED[name][0] == "MULTI_GPU"})
    # the child's process group listens on MASTER_PORT: a free one, so that another suite's launch cannot hold it
    child_env = dict(os.environ, LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(processes.free_port()), CUDA_VISIBLE_DEVICES="",
                     OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))  # fmt: skip
    command = [sys.executable, str(ROOT / "tests/dist_scripts/accelerate_prepare.py"), json.dumps(cases)]
    result = processes.run(command, env=child_env, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line[len("RESULT ") :]) for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    return {(line["config"], line["moe"]): line for line in lines}


@pytest.fixture(scope="module")
def prepared():
    pytest.importorskip("deepspeed")
    stale = stale_extension_locks()
    if stale:
        pytest.fail(
            f"stale torch-extension lock left by a killed process; DeepSpeed would wait on it forever: rm {stale[0]}"
        )
    names = [name for name in EXPECTED if name != "zero3_offload.yaml" or _cpu_adam_is_built()]
    return _prepare(sorted(names))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("name", sorted(name for name in EXPECTED if EXPECTED[name][0] == "DEEPSPEED"
                                        and name != "zero3_offload.yaml"))  # fmt: skip
def test_deepspeed_configs_prepare_dense_and_moe_models(prepared, name, moe):
    result = prepared[(name, moe)]
    if name == "zero3_moe.yaml" and not moe:  # the one config that is for MoE models only, as its header says
        assert result["error"] == (
            "Exception: Could not find a transformer layer class called 'Qwen3MoeSparseMoeBlock' to wrap in the model."
        )
        return
    assert "error" not in result, result
    assert (result["distributed_type"], result["wrapped"]) == ("DEEPSPEED", "DeepSpeedEngine")
    assert result["zero_stage"] == EXPECTED[name][1] and result["offload_optimizer"] == "none"
    assert result["base_optimizer"] == "AdamW"
    assert result["shm_all_reduce"] is False  # gloo; no 38-120 s JIT build of DeepSpeed's shared-memory op
    if result["zero_stage"] == 3:  # one ZeRO-3 leaf per MoE layer of the 2-layer model; none in a dense model
        assert result["leaves"] == (2 if moe else 0)
        assert_none_resident(result["zero3"])  # every forward of the step gathered its parameters
    assert 3.0 < result["loss"] < 6.0  # a finite language-model loss after a real optimizer step


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_single_and_multi_gpu_configs_prepare_on_cpu(prepared, moe):
    single, multi = prepared[("single_gpu.yaml", moe)], prepared[("multi_gpu.yaml", moe)]
    assert "error" not in single and "error" not in multi, (single, multi)
    assert single["distributed_type"] == "NO" and single["wrapped"] in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    # accelerate's CPU counterpart of multi-GPU data parallelism: DDP over gloo
    assert (multi["distributed_type"], multi["wrapped"]) == ("MULTI_CPU", "DistributedDataParallel")


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_fsdp2_config_wraps_each_decoder_layer(prepared, moe):
    result = prepared[("fsdp2.yaml", moe)]
    assert "error" not in result, result
    expected = "Qwen3MoeDecoderLayer" if moe else "Qwen3DecoderLayer"
    assert result["fsdp_version"] == 2 and result["wrapped_classes"] == [expected] and result["wrapped_count"] == 2


@pytest.mark.skipif(
    not _cpu_adam_is_built(),
    reason="DeepSpeed's cpu_adam op is not compiled yet (about 8 min on "
    "2 cores): python -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()'",
)
def test_offload_config_prepares_dense_and_moe_models_with_the_optimizer_on_cpu(prepared):
    for moe in (False, True):
        result = prepared[("zero3_offload.yaml", moe)]
        assert "error" not in result, result
        assert (result["wrapped"], result["zero_stage"], result["offload_optimizer"]) == ("DeepSpeedEngine", 3, "cpu")
        assert result["leaves"] == (2 if moe else 0) and 3.0 < result["loss"] < 6.0
        assert result["base_optimizer"] == "DeepSpeedCPUAdam"  # accelerate swaps AdamW for DeepSpeed's CPU Adam


def test_a_stale_extension_lock_is_found_and_a_fresh_one_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert stale_extension_locks() == []
    lock = _build_directory("cpu_adam") / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    os.utime(lock, (time.time() - 60, time.time() - 60))  # building now
    assert stale_extension_locks() == []
    os.utime(lock, (time.time() - 3600, time.time() - 3600))  # left by a process killed an hour ago
    assert stale_extension_locks() == [tmp_path / "cpu_adam" / "lock"]
