"""Shared fixtures: everything offline, tiny models built locally, CPU only."""

import gc
import json
import os
import sys
from pathlib import Path
from types import ModuleType

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRL_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import processes  # noqa: E402
import pytest  # noqa: E402
from filelock import FileLock  # noqa: E402

# torch, transformers and the package are imported by the processes that collect and run tests, not here: under
# xdist the controller, which runs no test, loads this file before it starts the workers (6 s of CPU, serial).


# The test tiers, by file (`pytest -m pure` runs the pure functions alone, in well under a minute). A test of a
# "trainer" file whose name says it launches processes is in the "processes" tier.
PURE = {
    "test_aggregation", "test_entropy_control", "test_batching", "test_plan_optimum", "test_update_path",
    "test_trl_mirror", "test_metric_functions", "test_staleness", "test_boundaries", "test_user_errors",
    "test_memory_estimate", "test_golds", "test_data", "test_vllm_utils", "test_evaluation_metrics", "test_tiny",
    "test_moe_edges", "test_row_contracts", "test_plotting", "test_study_pages", "test_recipes", "test_collectives",
}  # fmt: skip
PURE |= {"test_teardown_units", "test_routing_replay_counts", "test_rollout_routing_edges", "test_resume_marker",
         "test_resume_stop", "test_update_path_seam", "test_nonfinite_units", "test_conftest_lists"}  # fmt: skip
PROCESSES = {
    "test_distributed", "test_metrics_distributed", "test_evaluation_callback_distributed", "test_resume_processes",
    "test_resume_zero3", "test_processes", "test_scale_out_scripts", "test_notebook", "test_accelerate_configs",
    "test_printed_commands", "test_cli", "test_zero3_forwards", "test_cell_pool",
}  # fmt: skip


def tier(module: str, test: str) -> str:
    if module in PROCESSES or "two_processes" in test or "distributed" in test:
        return "processes"
    return "pure" if module in PURE else "trainer"


# The files that take longest (whole-suite runs with --durations=0, launches and module fixtures included), longest
# first. A file missing here only starts later than it could: a long one among the last files keeps one worker busy
# while the other, out of files, waits.
SLOWEST = ("test_torch_compile", "test_study_stops", "test_teardown", "test_shared_prompts", "test_scale_out_scripts",
           "test_gpu_dry_run", "test_processes", "test_rewards", "test_cell_pool", "test_cli", "test_fork_server",
           "test_trainer", "test_resume_zero3", "test_notebook", "test_feature_matrix", "test_gpu_check",
           "test_resume", "test_evaluation_callback_distributed", "test_trl_features", "test_routing_replay_trainer",
           "test_resume_processes", "test_dynamic_batching", "test_accelerate_configs", "test_cli_units",
           "test_nonfinite", "test_zero3_forwards", "test_bench_shapes", "test_grading_audit", "test_embedded",
           "test_padding_free", "test_trl_rows", "test_resume_epochs", "test_routing_replay_rollout",
           "test_hostile_completions", "test_trl_grpo_trainer", "test_metrics_distributed", "test_resume_moe",
           "test_distributed")  # fmt: skip
TIERS = ("processes", "trainer", "pure")


def pytest_collection_modifyitems(config, items):
    """Mark each test with its tier, and order the files: the slowest first, then the rest by tier (launching
    processes, training in this process, pure functions), each file's tests in collection order. With one file per
    worker at a time (`--dist loadfile --no-loadscope-reorder`, scripts/test.sh) the long files start first and the
    short ones fill in behind them, so no worker starts a minute-long launch when the other has nothing left."""
    rank = {}
    for item in items:
        name = tier(item.path.stem, item.name)
        item.add_marker(getattr(pytest.mark, name))
        own = SLOWEST.index(item.path.stem) if item.path.stem in SLOWEST else len(SLOWEST) + TIERS.index(name)
        rank[item.path] = min(rank.get(item.path, own), own)
    items.sort(key=lambda item: rank[item.path])  # stable: a file's tests keep their order


def pytest_collection_finish(session):
    """In a process that runs tests, once they are collected: one torch thread, and the heap that imports and
    collection built (torch, transformers, TRL, every test module) frozen. A full collection, which accelerate's
    `free_memory` runs at the end of every `train()`, then scans only what the tests create, not a few hundred
    thousand objects that live for the whole run (0.3 s a collection in a pytest worker). A frozen object is still
    freed when its last reference goes; only cycle collection skips it."""
    import torch

    torch.set_num_threads(1)  # tiny models run 15-25x faster on one thread than on two of a shared 2-core machine
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def tokenizer():
    from dhpo_trl.demo.tiny import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture
def tiny_model(tokenizer):
    from dhpo_trl.demo.tiny import build_tiny_qwen3

    return build_tiny_qwen3(tokenizer)


@pytest.fixture
def tiny_moe_model(tokenizer):
    from dhpo_trl.demo.tiny import build_tiny_qwen3

    return build_tiny_qwen3(tokenizer, moe=True)


@pytest.fixture
def leaf_spy(monkeypatch):
    """Replace `deepspeed.utils.set_z3_leaf_modules` (whether or not deepspeed is installed) and record calls."""
    calls = []
    fake_utils = ModuleType("deepspeed.utils")
    fake_utils.set_z3_leaf_modules = lambda model, classes: calls.append((model, list(classes)))
    fake_deepspeed = ModuleType("deepspeed")
    fake_deepspeed.utils = fake_utils
    monkeypatch.setitem(sys.modules, "deepspeed", fake_deepspeed)
    monkeypatch.setitem(sys.modules, "deepspeed.utils", fake_utils)
    return calls


@pytest.fixture(scope="session")
def two_process_update_paths(tmp_path_factory):
    """`run(engine)` -> (the launch's {"returncode", "stderr"}, its folder): one two-process launch per engine ("ddp",
    "zero3") of `dist_scripts/update_paths_distributed.py` for the whole test run, shared by the two-process tests
    of dynamic batching, packing and shared prompts (under xdist, by every worker, through a lock): each launch
    trains TRL's batching once for all three, and pays the processes' start once."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this run's folder, shared by its workers

    def run(engine: str):
        out = root / f"update_paths_{engine}"
        with FileLock(f"{out}.lock"):
            done = out / "launch.json"
            if not done.exists():
                out.mkdir(exist_ok=True)
                script = Path(__file__).parent / "dist_scripts" / "update_paths_distributed.py"
                result = processes.forked_ranks(script, out, *(["--zero3"] if engine == "zero3" else []), timeout=600,
                                                accelerate_cpu=engine == "ddp")  # set, ACCELERATE_USE_CPU keeps accelerate from DeepSpeed
                done.write_text(json.dumps({"returncode": result.returncode, "stderr": result.stderr[-4000:]}))
        return json.loads(done.read_text()), out

    return run


def pytest_sessionfinish(session, exitstatus):
    """The fork servers of this test process stopped with the session (`processes.forked_ranks`)."""
    if "fork_server" in sys.modules:
        sys.modules["fork_server"].stop_all()
