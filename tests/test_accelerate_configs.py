"""Every file in accelerate_configs/ loads with accelerate's own loader and launcher and says what its header says."""

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser

CONFIG_DIR = Path(__file__).resolve().parents[1] / "accelerate_configs"

# file -> (distributed type, ZeRO stage or None, processes, machines)
EXPECTED = {
    "single_gpu.yaml": ("NO", None, 1, 1),
    "multi_gpu.yaml": ("MULTI_GPU", None, 8, 1),
    "zero2.yaml": ("DEEPSPEED", 2, 8, 1),
    "zero3.yaml": ("DEEPSPEED", 3, 8, 1),
    "zero3_moe.yaml": ("DEEPSPEED", 3, 8, 1),
    "fsdp2.yaml": ("FSDP", None, 8, 1),
    "multi_node_zero3.yaml": ("DEEPSPEED", 3, 32, 4),
}


def _launch_args(name, *overrides):
    parser = launch_command_parser()
    args = parser.parse_args(["--config_file", str(CONFIG_DIR / name), *overrides, "train.py"])
    return _validate_launch_command(args)[0], {action.dest for action in parser._actions}


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


@pytest.mark.parametrize("name", ["zero3_moe.yaml", "multi_node_zero3.yaml"])
def test_moe_configs_name_the_qwen3_moe_block(name):
    args, _ = _launch_args(name)
    assert args.use_deepspeed and int(args.zero_stage) == 3
    assert args.deepspeed_moe_layer_cls_names == "Qwen3MoeSparseMoeBlock"


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
