"""The tiny `dhpo-train` run that the command's tests (tests/test_cli.py) and the exit check (scripts/exit_loop.py)
share: a local tiny Qwen3 folder, an 8-problem JSONL file, and the flags of a 2-step off-policy run on CPU."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

ENGINE_MODULE = "deepspeed.runtime.engine"


def write_model(folder: Path) -> Path:
    """A randomly initialised tiny Qwen3 and its character tokenizer, saved in `folder`."""
    from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3

    tokenizer = build_char_tokenizer()
    build_tiny_qwen3(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_problems(path: Path) -> Path:
    """8 problems `What is a + a?` with their answers, one JSON object a line (columns `problem`, `solution`)."""
    path.write_text("\n".join(json.dumps({"problem": f"What is {a} + {a}?", "solution": str(2 * a)}) for a in range(8)))
    return path


def train_flags(model, data, output_dir, *extra) -> list[str]:
    """2 optimizer steps, steps_per_generation 2 > gradient_accumulation_steps 1 (off-policy, as in the paper), a
    checkpoint at step 2, then the final save; `extra` flags come last (a repeated flag: the last one counts)."""
    return [
        "--model_name_or_path", str(model), "--dataset_name", str(data),
        "--question_column", "problem", "--answer_column", "solution",
        "--output_dir", str(output_dir), "--per_device_train_batch_size", "4", "--num_generations", "4",
        "--gradient_accumulation_steps", "1", "--steps_per_generation", "2", "--max_completion_length", "8",
        "--max_steps", "2", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "2",
        "--learning_rate", "1e-3", "--weight_decay", "0.1", "--use_cpu", "true", "--bf16", "false", "--report_to", "none",
        "--dataloader_num_workers", "0", *extra,
    ]  # fmt: skip


@contextlib.contextmanager
def exits_as_the_command(package: str = "deepspeed", engine: str = ENGINE_MODULE):
    """An input error's exit in a `dhpo-train` process never imports DeepSpeed's engine module, so the release at the
    exit skips the heap scans (tests/test_teardown.py). A pytest process that saved a model has imported it: hidden
    for the block, so that an in-process `main()` exits as the command does, not after seconds of scanning the test
    process's heap. The whole `package` is hidden, not the engine alone: in this process `import deepspeed` or `from
    deepspeed.runtime import engine` would find the loaded package and its attribute and import nothing, where the
    command imports the engine. On the way out: the block did not import it either (the input checks never load
    DeepSpeed), and the package's modules are this process's again, what the block imported dropped."""
    ours = lambda name: name == package or name.startswith(package + ".")  # noqa: E731
    saved = {name: module for name, module in sys.modules.items() if ours(name)}
    for name in saved:
        del sys.modules[name]
    try:
        yield
        assert engine not in sys.modules, "reading the input imported DeepSpeed's engine"
    finally:
        for name in [name for name in sys.modules if ours(name)]:
            del sys.modules[name]
        sys.modules.update(saved)
