"""vLLM server mode across a resume: the first generation after it uses the resumed weights.

The server is the project's fake one (tests/fake_cluster/fake_vllm_server.py: /health only, for the startup check);
TRL's vLLM backend is replaced by a stand-in that records what `sync_weights` would send (the policy's parameters at
that moment) and generates deterministic completions. TRL syncs when `global_step != _last_loaded_step`; the resumed
trainer starts at -1, so it must sync before its first generation, whatever the server held before.
"""

import os
import random
import socket
import sys
import time
import urllib.request
from pathlib import Path

import processes
import pytest
import torch
from datasets import Dataset

import dhpo_trl.training.vllm_utils as vllm_utils
from dhpo_trl import DHPOTrainer
from dhpo_trl.core.presets import config_for
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3

SERVER = Path(__file__).parent / "fake_cluster" / "fake_vllm_server.py"
CPU = dict(use_cpu=True, bf16=False, report_to="none", seed=0, data_seed=0)


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path_factory.mktemp("fake_vllm")
    env = {**os.environ, "FAKE_CLUSTER_LOG": str(log), "FAKE_VLLM_DELAY": "0"}
    command = [sys.executable, str(SERVER), "vllm-serve", "--model", "tiny", "--host", "127.0.0.1", "--port", str(port)]
    server = processes.popen(command, env=env, stdout=processes.DEVNULL, stderr=processes.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        else:
            pytest.fail("the fake vLLM server never answered /health")
        yield port
    finally:
        processes.kill_group(server)
        server.wait()


class StandInVLLM:
    """TRL's `VLLMGeneration` as the trainer uses it in server mode: `sync_weights()`, then `generate()`."""

    events: list = []

    def __init__(self, model, **kwargs):
        self.model = model
        self.trainer = None

    def sync_weights(self):
        params = {name: param.detach().clone() for name, param in self.model.named_parameters()}
        self.events.append(("sync", self.trainer.state.global_step, params))

    def generate(self, prompts, images, num_generations, profiler=None):
        step = self.trainer.state.global_step
        self.events.append(("generate", step, None))
        completions = []
        for index, prompt in enumerate(prompts):
            rng = random.Random(f"{prompt}|{index}|{step}")
            completions.append([rng.randint(3, 40) for _ in range(rng.randint(1, 6))])
        logprobs = [[[-1.0] for _ in completion] for completion in completions]
        return prompts, completions, logprobs, None


def digit_share(completions, **kwargs):
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


def train(port, output_dir, resume_from=None):
    trainer = built(port, output_dir, digit_share)
    trainer.train(resume_from_checkpoint=resume_from)
    return trainer, list(StandInVLLM.events)


def built(port, output_dir, reward):
    tok = build_char_tokenizer()
    StandInVLLM.events = []
    args = config_for(
        "DHPO-E", output_dir=str(output_dir), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, steps_per_generation=2, max_steps=6, logging_steps=1, learning_rate=3e-2,
        save_strategy="steps", save_steps=1, use_vllm=True, vllm_mode="server", vllm_server_host="127.0.0.1",
        vllm_server_port=port, vllm_importance_sampling_correction=False, **CPU,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [f"{a}+{2 * a + 1}=" for a in range(16)]})
    trainer = DHPOTrainer(model=build_tiny_qwen3(tok, hidden_size=32, seed=0), reward_funcs=reward, args=args,
                          train_dataset=dataset, processing_class=tok)  # fmt: skip
    trainer.vllm_generation.trainer = trainer
    return trainer


@pytest.fixture(scope="module")
def full_run(fake_server, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm_utils, "is_vllm_available", lambda *a, **k: True)
        patch.setattr("trl.trainer.grpo_trainer.VLLMGeneration", StandInVLLM)
        yield train(fake_server, tmp_path_factory.mktemp("full"))


@pytest.mark.parametrize("start", [2, 3])  # at a generation boundary (k = 2), and in the middle of a batch
def test_first_generation_after_resume_uses_the_resumed_weights(full_run, fake_server, tmp_path, monkeypatch, start):
    full, full_events = full_run
    assert [(kind, step) for kind, step, _ in full_events] == [
        ("sync", 0), ("generate", 0), ("sync", 2), ("generate", 2), ("sync", 4), ("generate", 4)]
    monkeypatch.setattr(vllm_utils, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr("trl.trainer.grpo_trainer.VLLMGeneration", StandInVLLM)
    resumed, events = train(fake_server, tmp_path, os.path.join(full.args.output_dir, f"checkpoint-{start}"))
    first_generation = 2 if start == 2 else 4
    assert [(kind, step) for kind, step, _ in events][:2] == [("sync", first_generation), ("generate", first_generation)]
    synced = events[0][2]
    expected = next(params for kind, step, params in full_events if kind == "sync" and step == first_generation)
    initial = full_events[0][2]
    for name, value in synced.items():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=0)
    assert max((synced[name] - initial[name]).abs().max().item() for name in synced) > 1e-3  # not the base model
    final = dict(resumed.model.named_parameters())
    assert max((param - final[name]).abs().max().item() for name, param in full.model.named_parameters()) <= 1e-6


def test_a_second_train_sends_the_weights_before_its_first_generation(fake_server, tmp_path, monkeypatch):
    """A run interrupted in its first generation batch (the server got the weights of step 0), then the model's
    weights changed in the session: the next `train()` sends them before it generates, as a new trainer does (TRL
    sends them when `global_step != _last_loaded_step`, which the interrupted run left at 0)."""
    monkeypatch.setattr(vllm_utils, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr("trl.trainer.grpo_trainer.VLLMGeneration", StandInVLLM)
    calls = []

    def interrupting(completions, **kwargs):
        calls.append(len(completions))
        if len(calls) == 1:
            raise KeyboardInterrupt
        return digit_share(completions)

    trainer = built(fake_server, tmp_path, interrupting)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert [(kind, step) for kind, step, _ in StandInVLLM.events] == [("sync", 0), ("generate", 0)]
    with torch.no_grad():  # other weights, as a cell that loads a checkpoint's
        for param in trainer.model.parameters():
            param.add_(0.01)
    changed = {name: param.detach().clone() for name, param in trainer.model.named_parameters()}
    StandInVLLM.events = []
    trainer.train()
    assert [(kind, step) for kind, step, _ in StandInVLLM.events][:2] == [("sync", 0), ("generate", 0)]
    for name, value in StandInVLLM.events[0][2].items():
        torch.testing.assert_close(value, changed[name], atol=0, rtol=0)


def test_a_resume_in_the_same_trainer_sends_the_checkpoints_weights_before_its_first_generation(
        fake_server, tmp_path, monkeypatch):  # fmt: skip
    """The trainer's last run left the server holding its weights of step 2 (its last generation batch); resuming
    another run's checkpoint at step 2 in the same trainer sends the checkpoint's weights before it generates at step
    2, as a new trainer resuming it does (TRL sends them only when `global_step != _last_loaded_step`)."""
    from safetensors.torch import load_file

    monkeypatch.setattr(vllm_utils, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr("trl.trainer.grpo_trainer.VLLMGeneration", StandInVLLM)
    other = built(fake_server, tmp_path / "other", digit_share)
    with torch.no_grad():  # another run: other weights from the start
        for param in other.model.parameters():
            param.add_(0.01)
    other.train()
    trainer = built(fake_server, tmp_path / "mine", digit_share)
    trainer.args.max_steps = 3  # generation batches at steps 0 and 2
    trainer.train()
    assert [(kind, step) for kind, step, _ in StandInVLLM.events][-2:] == [("sync", 2), ("generate", 2)]
    StandInVLLM.events = []
    trainer.train(resume_from_checkpoint=str(tmp_path / "other" / "checkpoint-2"))
    assert [(kind, step) for kind, step, _ in StandInVLLM.events][:2] == [("sync", 2), ("generate", 2)]
    saved = load_file(str(tmp_path / "other" / "checkpoint-2" / "model.safetensors"))
    sent = StandInVLLM.events[0][2]
    assert set(sent) <= set(saved) and max((sent[name] - saved[name]).abs().max().item() for name in sent) == 0
