"""`DHPOConfig.routing_replay` through `DHPOTrainer`: the pi_old pass records, every policy pass of the generation
batch runs the recorded experts (read by a spy on the experts modules, independently of the replay hooks), on the
padded, dynamic, packed and shared-prompt paths, with gradient checkpointing; refused where it cannot act."""

import json
import math
import socket
from pathlib import Path

import processes
import pytest
import torch
from datasets import Dataset
from transformers import Qwen3MoeForCausalLM

from dhpo_trl import DHPOConfig, DHPOTrainer
from dhpo_trl.demo.tiny import build_tiny_qwen3
from dhpo_trl.training import resume
from dhpo_trl.training import routing_replay as rr
from zero3_config import assert_none_resident


def _reward(completions, **kwargs):
    return [float(len(c) % 3) for c in completions]


def _config(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=1, steps_per_generation=4,
        max_completion_length=8, max_steps=4, logging_steps=1, learning_rate=5e-2, seed=0, routing_replay="old",
        beta=0.04,
    )  # fmt: skip
    kwargs.update(overrides)
    return DHPOConfig(**kwargs)


def _dataset(n=8):
    return Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(n)]})


@pytest.fixture
def moe_model(tiny_moe_model, tmp_path):
    tiny_moe_model.config.output_router_logits = False  # as tests/test_moe.py: generate() needs it off
    tiny_moe_model.save_pretrained(tmp_path / "model")  # TRL loads the reference model (beta > 0) from its path
    return Qwen3MoeForCausalLM.from_pretrained(tmp_path / "model")


def _spy(model, calls):
    return [m.register_forward_pre_hook(lambda m, args, name=name: calls.append((name, args[1].clone())))
            for name, m in model.named_modules() if name.endswith("mlp.experts")]  # fmt: skip


def test_every_policy_pass_runs_the_experts_of_the_pi_old_pass(tmp_path, moe_model, tokenizer):
    args = _config(tmp_path, dynamic_batching=False, padding_free=False, max_steps=5)  # two generation batches
    trainer = DHPOTrainer(moe_model, _reward, args=args, train_dataset=_dataset(), processing_class=tokenizer)
    old_pass, policy_passes = [], []
    generate = trainer._generate_and_score_completions

    def generate_and_spy(inputs):
        original = trainer._get_per_token_logps_and_entropies

        old_pass.clear()  # the last generation batch's passes are kept

        def first_pass_spied(*a, **k):  # TRL's log-prob passes of a batch: pi_old, then the reference
            calls = []
            handles = _spy(a[0], calls)
            try:
                return original(*a, **k)
            finally:
                for handle in handles:
                    handle.remove()
                old_pass.append((a[1], a[2], calls))

        trainer._get_per_token_logps_and_entropies = first_pass_spied
        try:
            return generate(inputs)
        finally:
            del trainer._get_per_token_logps_and_entropies

    compute_loss = trainer._compute_loss

    def compute_loss_spied(model, inputs):
        calls = []
        handles = _spy(trainer.model, calls)
        try:
            return compute_loss(model, inputs)
        finally:
            for handle in handles:
                handle.remove()
            policy_passes.append((inputs, calls[:2]))  # the forward's two layers (backward does not recompute)

    trainer._generate_and_score_completions = generate_and_spy
    trainer._compute_loss = compute_loss_spied
    trainer.train()

    def ran(ids, calls):  # (B, T, layers, top_k) as a pass's forwards ran it
        return torch.stack([torch.cat([c for n, c in calls if n == name]).view(*ids.shape, -1)
                            for name in dict(calls)], 2)  # fmt: skip

    ids, mask, calls = old_pass[0]
    recorded = ran(ids, calls)
    assert trainer.ref_model is not None and old_pass[1][0] is ids  # the reference pass over the same batch
    reference = ran(ids, old_pass[1][2])
    assert torch.equal(reference[mask.bool()], recorded[mask.bool()])
    live = []  # the reference model's own routing differs by now: the check above can fail
    with torch.no_grad():
        handles = _spy(trainer.ref_model, live)
        trainer.ref_model(input_ids=ids, attention_mask=mask)
        for handle in handles:
            handle.remove()
    assert not torch.equal(ran(ids, live)[mask.bool()], recorded[mask.bool()])
    flips = []
    for inputs, used in policy_passes:
        rows = inputs[rr.ROUTED_EXPERTS]
        sub_ids, sub_mask = rr.sequence_inputs(inputs)
        used = torch.stack([u.view(*sub_ids.shape, -1) for _, u in used], 2)
        assert torch.equal(used[sub_mask.bool()].long(), rows[rows[:, :, 0, 0] >= 0].long())
    # The rows of the batch equal what the pi_old pass ran, row by row (the batch is shuffled: match on ids).
    for inputs, _ in policy_passes[-1:]:
        sub_ids, sub_mask = rr.sequence_inputs(inputs)
        for row in range(sub_ids.size(0)):
            match = [i for i in range(ids.size(0)) if torch.equal(ids[i], sub_ids[row])]
            if match:
                want = recorded[match[0]][mask[match[0]].bool()]
                got = inputs[rr.ROUTED_EXPERTS][row]
                assert torch.equal(got[got[:, 0, 0] >= 0].long(), want.long())
    logs = [e for e in trainer.state.log_history if "moe/routing_flip_fraction" in e]
    assert len(logs) == 5 and all(e["moe/replayed_fraction"] == 1.0 for e in logs)
    flips = [e["moe/routing_flip_fraction"] for e in logs]
    # The first step of a generation batch runs pi_old's weights; then the routers drift.
    assert flips[0] == 0.0 and flips[4] == 0.0 and max(flips) > 0.0


@pytest.mark.parametrize("batching", [
    dict(dynamic_batching=True, padding_free=False),
    dict(dynamic_batching=True, padding_free=True),
    dict(dynamic_batching=True, padding_free=True, share_prompts=True),
    dict(dynamic_batching=False, padding_free=False, gradient_checkpointing=True),
])  # fmt: skip
def test_replay_acts_on_every_batching_path(tmp_path, moe_model, tokenizer, batching):
    args = _config(tmp_path, max_steps=3, **batching)
    trainer = DHPOTrainer(moe_model, _reward, args=args, train_dataset=_dataset(4), processing_class=tokenizer)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "moe/routing_flip_fraction" in e]
    assert len(logs) == 3 and all(e["moe/replayed_fraction"] == 1.0 for e in logs)
    assert all(math.isfinite(e["loss"]) for e in logs)


def test_none_installs_nothing_and_adds_nothing_to_the_batch(tmp_path, moe_model, tokenizer):
    args = _config(tmp_path, routing_replay="none")
    trainer = DHPOTrainer(moe_model, _reward, args=args, train_dataset=_dataset(4), processing_class=tokenizer)
    assert all(not router._forward_hooks for _, router in rr.routers(trainer.model))
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in _dataset(4)["prompt"]])
    assert rr.ROUTED_EXPERTS not in batch


def test_a_dense_model_is_refused_by_name(tmp_path, tiny_model, tokenizer):
    with pytest.raises(ValueError, match=r"routing_replay='old'.*dense model.*routing_replay='none'"):
        DHPOTrainer(tiny_model, _reward, args=_config(tmp_path, beta=0.0), train_dataset=_dataset(4),
                    processing_class=tokenizer)  # fmt: skip


def test_a_micro_batch_without_routing_is_refused_by_name(tmp_path, moe_model, tokenizer):
    trainer = DHPOTrainer(moe_model, _reward, args=_config(tmp_path), train_dataset=_dataset(4),
                          processing_class=tokenizer)  # fmt: skip
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in _dataset(4)["prompt"]])
    assert batch[rr.ROUTED_EXPERTS].dtype == torch.int16
    del batch[rr.ROUTED_EXPERTS]
    with pytest.raises(ValueError, match="routing_replay='old'.*routed_experts"):
        trainer._compute_loss(trainer.model, batch)


def test_config_refuses_what_cannot_act(tmp_path):
    with pytest.raises(ValueError, match="routing_replay='rollout'.*--enable-return-routed-experts"):
        _config(tmp_path, routing_replay="rollout")
    with pytest.raises(ValueError, match="routing_replay='old'.*on-policy"):
        _config(tmp_path, routing_replay="old", steps_per_generation=1)
    with pytest.raises(ValueError, match="routing_replay='r2'"):
        _config(tmp_path, routing_replay="r2")
    assert _config(tmp_path, routing_replay="none", steps_per_generation=1).routing_replay == "none"


def _run(tokenizer, output_dir, resume_from=None):
    args = _config(output_dir, beta=0.0, max_steps=6, save_strategy="steps", save_steps=1, data_seed=0)
    model = build_tiny_qwen3(tokenizer, moe=True, hidden_size=32, seed=0)
    if resume_from is not None:
        # The Trainer's own resume does not load this checkpoint's experts (transformers 5 saves them per expert,
        # the model holds them fused, and the Trainer's load skips the conversion): load the weights the
        # conversion-aware way, so that what is compared is the generation state this test is about.
        model = Qwen3MoeForCausalLM.from_pretrained(resume_from)
    trainer = DHPOTrainer(model, _reward, args=args, train_dataset=_dataset(), processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=resume_from)
    return trainer


def test_a_mid_generation_batch_resume_replays_the_saved_routing(tmp_path, tokenizer):
    """k = 4: the checkpoint at step 2 holds the rest of the generation batch with its pi_old routing; the resumed
    run replays that routing (not one recorded again with the step-2 weights): same parameters and metrics."""
    full = _run(tokenizer, tmp_path / "full")
    checkpoint = tmp_path / "full" / "checkpoint-2"
    state = torch.load(checkpoint / resume.GENERATION_STATE.format(rank=0), weights_only=True)
    buffered = resume.decode(state["_buffered_inputs"])
    assert all(part[rr.ROUTED_EXPERTS].dtype == torch.int16 for part in buffered)
    resumed = _run(tokenizer, tmp_path / "resumed", resume_from=str(checkpoint))
    other = dict(resumed.model.named_parameters())
    assert max((p - other[n]).abs().max().item() for n, p in full.model.named_parameters()) <= 1e-6
    logs = {e["step"]: e for e in full.state.log_history if "moe/routing_flip_fraction" in e}
    again = {e["step"]: e for e in resumed.state.log_history if "moe/routing_flip_fraction" in e and e["step"] > 2}
    assert sorted(again) == [3, 4, 5, 6] and max(logs[s]["moe/routing_flip_fraction"] for s in again) > 0
    for step in again:
        for key in ("loss", "moe/routing_flip_fraction", "moe/replayed_fraction"):
            assert again[step][key] == pytest.approx(logs[step][key], abs=1e-6), (step, key)


@pytest.mark.parametrize("engine", ["ddp", "zero3"])
def test_two_processes_replay_the_recorded_experts(tmp_path, engine):
    """2 ranks (gloo), DDP and ZeRO-3 (MoE blocks as leaf modules), in one launch: with "old", every policy pass of
    every rank runs the recorded experts for every token and layer, and the `moe/` metrics are logged from both
    ranks' counts; with "rollout" through TRL's client and the fake vLLM server, every forward of every rank
    (pi_old, policy, recomputed) runs the server's planted experts of that rank's own completions."""
    if engine == "zero3":
        pytest.importorskip("deepspeed")
    script = Path(__file__).parent / "dist_scripts" / "routing_replay_distributed.py"
    with socket.socket() as sock:  # the fake server's port (rank 0 starts it)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # without ACCELERATE_USE_CPU under ZeRO-3: set, it would keep accelerate from using the DeepSpeed plugin
    zero3 = ["--zero3"] if engine == "zero3" else []
    result = processes.forked_ranks(script, tmp_path, "--rollout-port", port, *zero3, timeout=300,
                                    accelerate_cpu=engine == "ddp")  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank in ranks:
        assert rank["checked"] == 4 and rank["differing"] == 0
        assert rank["replayed"] == [1.0] * 4 and rank["flip"][0] == 0.0 and max(rank["flip"]) > 0.0
    assert ranks[0]["flip"] == ranks[1]["flip"]  # reduced over both ranks before logging
    if engine == "zero3":  # no parameter resident: a forward one rank runs alone blocks the launch
        assert_none_resident(*(rank["zero3"] for rank in ranks))
    rollout = [json.loads((tmp_path / f"rollout_rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank in rollout:
        # one generation batch of 16 rows: TRL's pi_old pass in 4 chunks of 4, then 4 policy passes, each recomputed
        # under gradient checkpointing
        assert rank["forwards"] == 8 and rank["recomputed"] == 4 and rank["differing"] == 0
        assert rank["decisions"] >= 2 * 9 * 16  # layers x passes x at least one token of each of 16 rows
        assert rank["replayed"] == [1.0] * 4 and min(rank["flip"]) > 0.3  # the live routers disagree with the plant
    assert not set(map(tuple, rollout[0]["sequences"])) & set(map(tuple, rollout[1]["sequences"]))  # own prompts
    assert rollout[0]["flip"] == rollout[1]["flip"]
    assert (tmp_path / "fake_vllm_log" / "server.pid").is_file()  # the server's log in the run's directory, not /tmp


def test_replay_resumed_from_a_batch_saved_without_routing_is_refused_at_train(tmp_path, tokenizer):
    """A mid-generation-batch checkpoint of a routing_replay='none' run holds no routing: resuming it with 'old' is
    refused by train(), naming the setting, before any optimizer step."""
    args = _config(tmp_path / "none", routing_replay="none", beta=0.0, max_steps=2, save_strategy="steps",
                   save_steps=2)  # fmt: skip
    model = build_tiny_qwen3(tokenizer, moe=True, hidden_size=32, seed=0)
    DHPOTrainer(model, _reward, args=args, train_dataset=_dataset(), processing_class=tokenizer).train()
    args = _config(tmp_path / "old", beta=0.0, max_steps=4)
    trainer = DHPOTrainer(build_tiny_qwen3(tokenizer, moe=True, hidden_size=32, seed=0), _reward, args=args,
                          train_dataset=_dataset(), processing_class=tokenizer)  # fmt: skip
    with pytest.raises(ValueError, match="routing_replay='old'"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "none" / "checkpoint-2"))
    fresh = dict(build_tiny_qwen3(tokenizer, moe=True, hidden_size=32, seed=0).named_parameters())
    assert all(torch.equal(p, fresh[n]) for n, p in trainer.model.named_parameters())  # no checkpoint weight loaded
