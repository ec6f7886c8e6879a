"""`routing_replay="rollout"` (R3) through TRL's own vLLM client and the project's fake server, which returns planted
routing (tests/fake_cluster/fake_vllm_server.py, `planted_experts`): every log-prob pass (pi_old, reference, policy)
runs the planted experts for every token and layer, read by a spy on the experts modules and the decoder's inputs,
on the padded, dynamic, packed and shared-prompt paths; a server without routing is refused before any model loads;
routing that does not cover the tokens is an error before the update; a resume mid-generation-batch equals the
uninterrupted run; colocated, TRL's engine is built to return routing and its routing is what every pass runs. TRL's
weight sync (NCCL) is replaced by no-ops: it is not what these tests are about."""

import importlib.util
import os
import socket
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import processes
import pytest
import torch
from datasets import Dataset
from transformers import Qwen3MoeForCausalLM

import dhpo_trl.training.vllm_utils as vllm_utils
from dhpo_trl import DHPOConfig, DHPOTrainer
from dhpo_trl.demo.tiny import build_tiny_qwen3
from dhpo_trl.training import resume
from dhpo_trl.training import routing_replay as rr

pytest.importorskip("requests")  # TRL's vLLM client
SERVER = Path(__file__).parent / "fake_cluster" / "fake_vllm_server.py"
_spec = importlib.util.spec_from_file_location("fake_vllm_server", SERVER)
fake = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake)
LAYERS, TOP_K, EXPERTS = 2, 2, 4  # build_tiny_qwen3(moe=True)


def _start(log_dir, *flags, routing="full"):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "FAKE_CLUSTER_LOG": str(log_dir), "FAKE_VLLM_DELAY": "0",
           "FAKE_VLLM_MOE": f"{LAYERS},{TOP_K},{EXPERTS}", "FAKE_VLLM_ROUTING": routing}  # fmt: skip
    command = [sys.executable, str(SERVER), "vllm-serve", "--model", "tiny-moe", "--host", "127.0.0.1", "--port",
               str(port), *flags]  # fmt: skip
    server = processes.popen(command, env=env, stdout=processes.DEVNULL, stderr=processes.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as answer:
                if answer.status == 200:
                    return server, port
        except OSError:
            time.sleep(0.2)
    processes.kill_group(server)
    pytest.fail("the fake vLLM server never answered /health")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Fake servers by kind, started on first use: "routed" (--enable-return-routed-experts), "plain" (without),
    "short_prompt" (routed, one prompt token short)."""
    started, ports = [], {}

    def port(kind):
        if kind not in ports:
            flags = () if kind == "plain" else (fake.ROUTING_FLAG,)
            server, ports[kind] = _start(tmp_path_factory.mktemp(kind), *flags,
                                         routing="full" if kind == "plain" else kind.replace("routed", "full"))
            started.append(server)
        return ports[kind]

    yield port
    for server in started:
        processes.kill_group(server)
        server.wait()


@pytest.fixture
def trl_server_mode(monkeypatch):
    """TRL's `VLLMGeneration` and `VLLMClient` in server mode on CPU: vllm is not installed, the weight sync is off."""
    from trl.generation import vllm_client, vllm_generation

    for module in (vllm_client, vllm_generation, vllm_utils):
        monkeypatch.setattr(module, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr(vllm_client.VLLMClient, "init_communicator", lambda self, device=0: None)
    monkeypatch.setattr(vllm_client.VLLMClient, "update_named_params", lambda self, *a, **k: None)
    monkeypatch.setattr(vllm_client.VLLMClient, "reset_prefix_cache", lambda self: None)


def _reward(completions, **kwargs):
    return [float(len(c) % 3) for c in completions]


def _dataset(n=8):
    return Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(n)]})


def _config(tmp_path, port, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=1, steps_per_generation=4,
        max_completion_length=8, max_steps=4, logging_steps=1, learning_rate=5e-2, seed=0, routing_replay="rollout",
        beta=0.04, use_vllm=True, vllm_mode="server", vllm_server_host="127.0.0.1", vllm_server_port=port,
        vllm_server_timeout=30,
    )  # fmt: skip
    kwargs.update(overrides)
    return DHPOConfig(**kwargs)


@pytest.fixture
def moe_path(tokenizer, tmp_path):
    model = build_tiny_qwen3(tokenizer, moe=True, hidden_size=32, seed=0)
    model.save_pretrained(tmp_path / "model")  # TRL loads the reference model (beta > 0) from its path
    return tmp_path / "model"


def _planted(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(n, layers, top_k) planted experts of tokens given by id and position in their sequence."""
    return torch.tensor([[fake.planted_experts(int(t), int(p), layer, TOP_K, EXPERTS) for layer in range(LAYERS)]
                         for t, p in zip(ids.tolist(), positions.tolist())])  # fmt: skip


class Spy:
    """Every decoder forward of the spied models: its routed tokens' ids and positions, and what each layer's experts
    module was given (`top_k_index`), in call order (TRL's default gradient checkpointing runs each layer again in
    the backward: those calls are checked too)."""

    def __init__(self, *models):
        self.forwards, self.handles = [], []
        for model in models:
            decoder = model.get_decoder()
            self.handles.append(decoder.register_forward_pre_hook(self._start, with_kwargs=True))
            layer = 0
            for name, module in model.named_modules():
                if name.endswith("mlp.experts"):
                    self.handles.append(module.register_forward_pre_hook(
                        lambda m, args, layer=layer: self.forwards[-1]["used"].append((layer, args[1].detach().clone()))))
                    layer += 1

    def _start(self, module, args, kwargs):
        ids, mask, positions = kwargs.get("input_ids"), kwargs.get("attention_mask"), kwargs.get("position_ids")
        if mask is not None and mask.dim() == 2:  # padded rows: a token's position counts the attended ones
            where = mask.flatten().bool()
            pos = (torch.cumsum(mask.long(), 1) - 1).flatten()[where]
        else:  # packed rows: positions given
            where = torch.ones(ids.numel(), dtype=torch.bool)
            pos = positions.flatten()
        self.forwards.append({"ids": ids.flatten()[where], "positions": pos, "where": where, "used": []})

    def remove(self):
        for handle in self.handles:
            handle.remove()


def _train_spied(trainer) -> list[dict]:
    """Train with a `Spy` on the policy and reference models; its forwards (the hooks go whether training ends or
    fails)."""
    spy = Spy(trainer.model, trainer.ref_model)
    try:
        trainer.train()
    finally:
        spy.remove()
    return spy.forwards


@pytest.mark.parametrize("batching", [
    dict(dynamic_batching=False, padding_free=False),
    dict(dynamic_batching=True, padding_free=False),
    dict(dynamic_batching=True, padding_free=True),
    dict(dynamic_batching=True, padding_free=True, share_prompts=True),
])  # fmt: skip
def test_every_pass_runs_the_servers_routing(tmp_path, servers, trl_server_mode, tokenizer, moe_path, batching):
    args = _config(tmp_path, servers("routed"), max_steps=5, **batching)  # two generation batches
    trainer = DHPOTrainer(str(moe_path), _reward, args=args, train_dataset=_dataset(), processing_class=tokenizer)
    forwards = _train_spied(trainer)
    # per generation batch: pi_old, reference, then one policy forward per step (more where dynamic batching splits)
    assert len(forwards) >= 2 * 2 + 5
    recomputed = 0
    for forward in forwards:
        assert sorted(layer for layer, _ in forward["used"][:LAYERS]) == list(range(LAYERS))
        recomputed += len(forward["used"]) > LAYERS
        planted = _planted(forward["ids"], forward["positions"]).sort(-1).values
        for layer, used in forward["used"]:
            assert torch.equal(used[forward["where"]].sort(-1).values, planted[:, layer])
    assert recomputed >= 5  # every policy forward ran again under gradient checkpointing, replayed again
    logs = [e for e in trainer.state.log_history if "moe/routing_flip_fraction" in e]
    assert len(logs) == 5 and all(e["moe/replayed_fraction"] == 1.0 for e in logs)
    assert min(e["moe/routing_flip_fraction"] for e in logs) > 0.3  # the live routers disagree with the planted ones


def test_the_batch_carries_the_servers_routing_as_int16_rows(tmp_path, servers, trl_server_mode, tokenizer, moe_path):
    args = _config(tmp_path, servers("routed"))
    trainer = DHPOTrainer(str(moe_path), _reward, args=args, train_dataset=_dataset(4), processing_class=tokenizer)
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in _dataset(4)["prompt"] for _ in range(4)])
    rows = batch[rr.ROUTED_EXPERTS]
    assert rows.dtype == torch.int16 and trainer._routing.rollout._local == []  # dropped once scattered
    ids, mask = rr.sequence_inputs(batch)
    positions = torch.cumsum(mask.long(), 1) - 1
    attended = mask.bool()
    assert torch.equal(rows[attended].long(), _planted(ids[attended], positions[attended]))
    assert bool((rows[~attended] == -1).all())


def test_a_server_started_without_routing_is_refused_before_any_model_loads(tmp_path, servers, trl_server_mode,
                                                                            tokenizer):  # fmt: skip
    args = _config(tmp_path, servers("plain"))
    with pytest.raises(ValueError, match=r"routing_replay='rollout'.*--enable-return-routed-experts"):
        DHPOTrainer("no-such-model-is-loaded", _reward, args=args, train_dataset=_dataset(), processing_class=tokenizer)


def test_routing_that_does_not_cover_the_tokens_fails_before_the_update(tmp_path, servers, trl_server_mode,
                                                                        tokenizer, moe_path):  # fmt: skip
    args = _config(tmp_path, servers("short_prompt"))
    trainer = DHPOTrainer(str(moe_path), _reward, args=args, train_dataset=_dataset(), processing_class=tokenizer)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    with pytest.raises(ValueError, match=r"prompt_routed_experts \(\d+, 2, 2\) for a prompt of \d+ tokens"):
        trainer.train()
    assert all(torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())


def test_without_vllm_rollout_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"routing_replay='rollout'.*use_vllm=False.*set use_vllm=True"):
        _config(tmp_path, 8000, use_vllm=False)


def _run(port, tokenizer, output_dir, resume_from=None):
    args = _config(output_dir, port, beta=0.0, max_steps=6, save_strategy="steps", save_steps=1, data_seed=0)
    model = build_tiny_qwen3(tokenizer, moe=True, hidden_size=32, seed=0)
    if resume_from is not None:  # as tests/test_routing_replay_trainer.py: the conversion-aware load of the experts
        model = Qwen3MoeForCausalLM.from_pretrained(resume_from)
    trainer = DHPOTrainer(model, _reward, args=args, train_dataset=_dataset(), processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=resume_from)
    return trainer


def test_a_mid_generation_batch_resume_replays_the_saved_rollout_routing(tmp_path, servers, trl_server_mode,
                                                                         tokenizer):  # fmt: skip
    """k = 4: the checkpoint at step 2 holds the rest of the generation batch with the server's routing; the resumed
    run replays it: the same parameters, losses and `moe/` metrics as the uninterrupted run."""
    port = servers("routed")
    full = _run(port, tokenizer, tmp_path / "full")
    checkpoint = tmp_path / "full" / "checkpoint-2"
    state = torch.load(checkpoint / resume.GENERATION_STATE.format(rank=0), weights_only=True)
    buffered = resume.decode(state["_buffered_inputs"])
    for part in buffered:
        ids, mask = rr.sequence_inputs(part)
        positions, attended = torch.cumsum(mask.long(), 1) - 1, mask.bool()
        rows = part[rr.ROUTED_EXPERTS]  # its columns may outnumber the trimmed rows': each row's routed tokens in order
        assert torch.equal(rows[rows[:, :, 0, 0] >= 0].long(), _planted(ids[attended], positions[attended]))
    resumed = _run(port, tokenizer, tmp_path / "resumed", resume_from=str(checkpoint))
    other = dict(resumed.model.named_parameters())
    assert max((p - other[n]).abs().max().item() for n, p in full.model.named_parameters()) <= 1e-6
    logs = {e["step"]: e for e in full.state.log_history if "moe/routing_flip_fraction" in e}
    again = {e["step"]: e for e in resumed.state.log_history if "moe/routing_flip_fraction" in e and e["step"] > 2}
    assert sorted(again) == [3, 4, 5, 6]
    for step in again:
        for key in ("loss", "moe/routing_flip_fraction", "moe/replayed_fraction"):
            assert again[step][key] == pytest.approx(logs[step][key], abs=1e-6), (step, key)


class _Engine:
    """vLLM's offline `LLM` as TRL's colocate mode uses it, generating like the fake server; it returns the planted
    routing only when built with enable_return_routed_experts=True, as vLLM does."""

    built: list = []

    def __init__(self, model, **kwargs):
        _Engine.built.append(kwargs)
        self.routing = kwargs.get("enable_return_routed_experts", False)
        runner = SimpleNamespace(model=SimpleNamespace(load_weights=lambda weights: None))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(
            model_runner=runner)))  # fmt: skip

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        reply = fake.completions({"prompt": [p["prompt_token_ids"] for p in prompts], "n": 1, "max_tokens": 8},
                                 {"model": "tiny-moe", "moe": [LAYERS, TOP_K, EXPERTS],
                                  "routing": "full" if self.routing else None})  # fmt: skip
        shared = reply.get("prompt_routed_experts")
        return [SimpleNamespace(prompt_token_ids=choice["prompt_token_ids"],
                                prompt_routed_experts=np.array(shared[i], dtype=np.int16) if shared else None,
                                outputs=[SimpleNamespace(token_ids=choice["token_ids"], logprobs=[
                                    {t: SimpleNamespace(logprob=-1.0, rank=1)} for t in choice["token_ids"]],
                                                         routed_experts=np.array(choice["routed_experts"], np.int16)
                                                         if self.routing else None)])
                for i, choice in enumerate(reply["choices"])]  # fmt: skip


def test_colocated_engine_is_built_to_return_routing_and_every_pass_runs_it(tmp_path, monkeypatch, tokenizer,
                                                                            moe_path):  # fmt: skip
    from trl.generation import vllm_generation

    monkeypatch.setattr(vllm_generation, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr(vllm_utils, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr(vllm_generation, "LLM", _Engine, raising=False)
    monkeypatch.setattr(vllm_generation, "SamplingParams", lambda **kwargs: kwargs, raising=False)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # TRL sets them for vLLM:
        monkeypatch.setenv(name, "")  # restored to what they were after the test
        monkeypatch.delenv(name)
    args = _config(tmp_path, 0, vllm_mode="colocate", vllm_importance_sampling_correction=False, max_steps=5)
    trainer = DHPOTrainer(str(moe_path), _reward, args=args, train_dataset=_dataset(), processing_class=tokenizer)
    assert _Engine.built[-1]["enable_return_routed_experts"] is True and vllm_generation.LLM is _Engine
    forwards = _train_spied(trainer)
    assert len(forwards) >= 2 * 2 + 5
    for forward in forwards:
        planted = _planted(forward["ids"], forward["positions"]).sort(-1).values
        for layer, used in forward["used"]:
            assert torch.equal(used[forward["where"]].sort(-1).values, planted[:, layer])
    logs = [e for e in trainer.state.log_history if "moe/routing_flip_fraction" in e]
    assert len(logs) == 5 and all(e["moe/replayed_fraction"] == 1.0 for e in logs)
