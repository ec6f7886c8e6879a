"""The scale-out shell scripts parse; the GPU smoke script's Python runs on CPU (its GPU run needs a lent GPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHELL_SCRIPTS = [
    "examples/vllm_server/serve_and_train_single_node.sh",
    "examples/vllm_server/slurm_multi_node.sh",
    "scripts/gpu_zero3_moe_smoke.sh",
]


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_script_parses_and_uses_existing_files(script):
    subprocess.run(["bash", "-n", str(ROOT / script)], check=True)
    text = (ROOT / script).read_text()
    for referenced in ("accelerate_configs/zero3.yaml", "accelerate_configs/zero3_moe.yaml",
                       "accelerate_configs/multi_node_zero3.yaml", "examples/train_dhpo.py",
                       "scripts/gpu_zero3_moe_smoke.py"):  # fmt: skip
        if referenced in text:
            assert (ROOT / referenced).is_file(), f"{script} refers to missing {referenced}"


def test_vllm_scripts_pass_server_settings_the_trainer_reads():
    from dhpo_trl import DHPOConfig

    fields = set(DHPOConfig.__dataclass_fields__)
    for script in SHELL_SCRIPTS[:2]:
        text = (ROOT / script).read_text()
        for flag in ("use_vllm", "vllm_mode", "vllm_server_host", "vllm_server_port", "vllm_server_timeout"):
            assert f"--{flag} " in text and flag in fields, (script, flag)
        assert "trl vllm-serve --model" in text and "--tensor-parallel-size" in text


def test_smoke_script_under_deepspeed_zero3_on_two_cpu_processes(tmp_path):
    """Real DeepSpeed ZeRO-3 (CPU accelerator, gloo): the engine sees every MoE block as a leaf; no hang."""
    pytest.importorskip("deepspeed")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "scripts/gpu_zero3_moe_smoke.py"), "--cpu", "--cpu_zero3", "--steps", "3",
               "--hidden_size", "32", "--max_completion_length", "8", "--output_dir", str(tmp_path)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("SMOKE OK") == 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["deepspeed"], summary["zero_stage"], summary["processes"]) == (True, 3, 2)
    assert summary["wrapped_model"] == "DeepSpeedEngine"
    assert summary["zero3_leaf_modules"] == ["Qwen3MoeSparseMoeBlock"]
    assert summary["z3_leaf_flagged_modules"] == 4  # one MoE block per layer of the 4-layer model
    assert summary["steps"] == 3 and all(entry["aux_loss"] > 0 for entry in summary["log"])


def test_smoke_script_runs_on_cpu(tmp_path):
    command = [sys.executable, str(ROOT / "scripts/gpu_zero3_moe_smoke.py"), "--cpu", "--steps", "2",
               "--hidden_size", "32", "--max_completion_length", "8", "--output_dir", str(tmp_path)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SMOKE OK" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["deepspeed"] is False and summary["zero3_leaf_modules"] == [] and summary["steps"] == 2
    assert all(entry["aux_loss"] > 0 for entry in summary["log"])
