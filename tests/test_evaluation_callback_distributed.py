"""BenchmarkEvalCallback on 2 CPU processes (torchrun's environment, gloo), with DDP and with DeepSpeed ZeRO-3: each
process samples its share of the problems, and the logged scores equal those of one process evaluating everything
itself.

The policy is a tiny model fine-tuned for a few seconds to answer `\\boxed{3}` or `\\boxed{4}` at random, so the
scores depend on every sample drawn (a random model scores 0 everywhere and any split would "match").
"""

import json
import random
from pathlib import Path

import processes
import pytest
import torch

from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from dhpo_trl.evaluation import BenchmarkEvalCallback
from dhpo_trl.scoring.data import format_prompt
from zero3_config import assert_none_resident

SCRIPT = Path(__file__).parent / "dist_scripts" / "eval_callback_distributed.py"
COLLECTIVE_SECONDS = 60  # the script's ddp_timeout
# Small batches, so that each benchmark makes several units: gsm8k 12 units of 1 problem x 3 samples, math500 3
# units of 4 problems (an odd count: under ZeRO-3 one process pads with a repeat).
CALLBACK = {"samples": {"gsm8k": 3, "math500": 1}, "max_new_tokens": 12, "batch_size": 4, "limit": None, "seed": 5}
ROWS = {  # 12 problems per benchmark; the answer is 3 or 4, the two the model says
    "gsm8k": [{"question": f"What is {a} plus {b}?", "answer": f"{a} + {b}\n#### {3 + (a + b) % 2}"}
              for a in range(4) for b in range(3)],
    "math500": [{"problem": f"What is {a} plus {b}?", "answer": str(4 - a % 2)} for a in range(6) for b in range(2)],
}  # fmt: skip


def _boxed_answer_model(path: Path) -> None:
    """Fine-tune the tiny model to answer ` \\boxed{3}` or ` \\boxed{4}` at random after any SimpleRL prompt."""
    torch.manual_seed(0)
    rng = random.Random(0)
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(tokenizer)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(50):
        prompts = [tokenizer(format_prompt(f"What is {rng.randrange(6)} plus {rng.randrange(6)}?", tokenizer))
                   ["input_ids"] for _ in range(16)]  # fmt: skip
        targets = [
            tokenizer(f" \\boxed{{{rng.choice('34')}}}")["input_ids"] + [tokenizer.eos_token_id] for _ in prompts
        ]
        width = max(len(p) + len(t) for p, t in zip(prompts, targets))
        rows = [[tokenizer.pad_token_id] * (width - len(p) - len(t)) + p + t for p, t in zip(prompts, targets)]
        labels = [[-100] * (width - len(t)) + t for t in targets]
        mask = [[int(i >= width - len(p) - len(t)) for i in range(width)] for p, t in zip(prompts, targets)]
        loss = model(input_ids=torch.tensor(rows), attention_mask=torch.tensor(mask), labels=torch.tensor(labels)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_policy")
    _boxed_answer_model(root / "model")
    (root / "eval.json").write_text(json.dumps({"benchmarks": ROWS, "callback": CALLBACK}))
    return root


def _two_ranks(policy, out_dir, *flags):
    result = processes.forked_ranks(SCRIPT, out_dir, policy / "model", policy / "eval.json", *flags, timeout=300,
                                    accelerate_cpu=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    dumps = [json.loads((out_dir / f"eval_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [dump["world_size"] for dump in dumps] == [2, 2]
    # The config's ddp_timeout reached the CPU process group (transformers alone starts it with torch's 30 minutes).
    assert [dump["collective_seconds"] for dump in dumps] == [COLLECTIVE_SECONDS] * 2
    return dumps


def _single_process_scores(policy, weights=None):
    """What one process logs for the same policy: the callback's own evaluate(), no torch.distributed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(policy / "model", dtype=torch.float32)
    if weights is not None:
        model.load_state_dict(weights)
    callback = BenchmarkEvalCallback(ROWS, **CALLBACK)
    return callback.evaluate(model, AutoTokenizer.from_pretrained(policy / "model"))


def _check_logged_equals_single_process(dumps, expected_by_step):
    for dump in dumps:
        logged = {entry["step"]: {k: v for k, v in entry.items() if k != "step"} for entry in dump["history"]}
        assert logged == expected_by_step  # exact: the same samples, whichever process drew them


def test_ddp_processes_split_the_problems_and_log_single_process_scores(policy, tmp_path):
    # 2e-3, not the script's 5e-4: two steps at 5e-4 move the weights by ~1e-3, which flips none of the 48 sampled
    # answers of this policy (it did by chance while "\n\n" in the prompt was one <|unk|> token); at 2e-3 both
    # benchmarks' scores move and stay strictly between 0 and 100.
    dumps = _two_ranks(policy, tmp_path, "--steps", "2", "--learning_rate", "2e-3")
    initial = _single_process_scores(policy)
    final = _single_process_scores(policy, torch.load(tmp_path / "final.pt"))
    for scores in (initial, final):  # scores that samples decide, before and after training
        assert 0 < scores["eval/gsm8k"] < 100 and 0 < scores["eval/math500"] < 100, scores
    assert final != initial  # training moved the policy: the step-2 check is a second, different one
    _check_logged_equals_single_process(dumps, {0: initial, 2: final})
    for evaluation in range(2):  # each process sampled a share; together, every problem exactly once
        prompts = [dump["evaluations"][evaluation]["prompts"] for dump in dumps]
        assert min(prompts) > 0 and sum(prompts) == len(ROWS["gsm8k"]) + len(ROWS["math500"]), prompts


def test_zero3_gathers_the_weights_once_and_logs_single_process_scores(policy, tmp_path):
    pytest.importorskip("deepspeed")
    dumps = _two_ranks(policy, tmp_path, "--zero3", "--steps", "1")
    assert all(dump["deepspeed"] for dump in dumps)
    assert_none_resident(*(dump["zero3"] for dump in dumps))  # an evaluation forward one rank ran alone would block
    final = _single_process_scores(policy, torch.load(tmp_path / "final.pt"))
    _check_logged_equals_single_process(dumps, {0: _single_process_scores(policy), 1: final})
    for dump in dumps:
        # No layer-by-layer fetch while evaluating; the same counter sees them on the partitioned model.
        assert [evaluation["zero3_fetches"] for evaluation in dump["evaluations"]] == [0, 0]
        assert dump["control"]["zero3_fetches"] > 0
    # ZeRO-3 decodes in lockstep: both processes made the same number of generate() calls
    for evaluation in range(2):
        calls = [dump["evaluations"][evaluation]["generate_calls"] for dump in dumps]
        assert calls[0] == calls[1] > 0
