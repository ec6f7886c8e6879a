"""Run under `torchrun --nproc_per_node N` on CPU (gloo): off-policy DHPO-A steps on the tiny Qwen3-MoE with
`routing_replay="old"` (and "rollout", below), TRL's batching (each policy pass one padded forward of its micro-batch).

Usage: torchrun --nproc_per_node N tests/dist_scripts/routing_replay_distributed.py OUT_DIR [--zero3]
           [--rollout-port P]

Every rank compares, in every policy pass, the experts each expert block received (a spy on the `experts` modules)
with the micro-batch's recorded routing, token by token, and writes OUT_DIR/rank{r}.json: the passes checked, the
token-layer decisions that differed, and the logged `moe/` metrics.

--rollout-port P: then, in the same launch (the processes' start is paid once), `routing_replay="rollout"` (R3)
through TRL's own vLLM client in server mode against the project's fake server (tests/fake_cluster/
fake_vllm_server.py), which rank 0 starts on port P and which returns planted routing for every token. Every rank
checks every forward of its model (pi_old and policy passes, gradient checkpointing's recomputation included):
the experts each block ran equal the planted ones of the tokens it was given (their ids and positions, read from
the decoder's inputs), and writes OUT_DIR/rollout_rank{r}.json.
"""

import contextlib
import ctypes
import functools
import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

if "--zero3" in sys.argv:
    from dhpo_trl.demo.tiny import use_deepspeed_on_cpu

    use_deepspeed_on_cpu()  # before deepspeed is first imported

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

from dhpo_trl.training.teardown import release_process_groups  # noqa: E402

from dhpo_trl import DHPOTrainer  # noqa: E402
from dhpo_trl.core.presets import config_for  # noqa: E402
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3  # noqa: E402
from dhpo_trl.training import routing_replay  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))  # tests/processes.py: the fake server's process group ended on the way out
import processes  # noqa: E402
from zero3_config import residency, zero3  # noqa: E402

_spec = importlib.util.spec_from_file_location("fake_vllm_server", TESTS / "fake_cluster" / "fake_vllm_server.py")
fake = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake)
LAYERS, TOP_K, EXPERTS = 2, 2, 4  # build_tiny_qwen3(moe=True)

ZERO3 = zero3()  # every forward gathers from both ranks: a forward one rank runs alone blocks


class CheckingTrainer(DHPOTrainer):
    """Checks the experts of every policy pass against the micro-batch's recorded routing."""

    checked = 0
    differing = 0

    def _compute_loss(self, model, inputs):
        calls = []
        handles = [m.register_forward_pre_hook(lambda m, args: calls.append(args[1].clone()))
                   for name, m in self.model.named_modules() if name.endswith("mlp.experts")]  # fmt: skip
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            for handle in handles:
                handle.remove()
        ids, mask = routing_replay.sequence_inputs(inputs)
        rows = inputs[routing_replay.ROUTED_EXPERTS]
        recorded = rows[rows[:, :, 0, 0] >= 0].long()  # (tokens, layers, top_k), row-major
        used = torch.stack([c.view(*ids.shape, -1)[mask.bool()] for c in calls[: recorded.size(1)]], 1)
        type(self).checked += 1
        type(self).differing += int((used.sort(-1).values != recorded.sort(-1).values).any(-1).sum())
        return loss


def reward(completions, **kwargs):
    return [float(len(c) % 3) for c in completions]


def config(out_dir: Path, zero3: bool, **overrides):
    return config_for(
        "DHPO-A", output_dir=str(out_dir), per_device_train_batch_size=4, num_generations=4,
        gradient_accumulation_steps=1, steps_per_generation=4, max_completion_length=8, max_steps=4,
        learning_rate=5e-2, use_cpu=True, bf16=False, report_to="none", seed=0, data_seed=0, save_strategy="no",
        logging_steps=1, disable_tqdm=True, deepspeed=ZERO3 if zero3 else None, dynamic_batching=False,
        padding_free=False, **overrides,
    )  # fmt: skip


def die_with(parent: int) -> None:
    """In the server's process, before it runs: the kernel kills it when rank 0 ends, however rank 0 ends (a crash,
    or torchrun's SIGTERM to the other ranks, skips rank 0's `finally`)."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # rank 0 ended before the signal was armed
        os._exit(1)


@contextlib.contextmanager
def fake_server(port: int | None, log: Path):
    """Rank 0 starts the fake vLLM server with routing on (only the main process talks to it, as in TRL); its log in
    `log`, inside the run's output directory."""
    if port is None or int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    log.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "FAKE_CLUSTER_LOG": str(log), "FAKE_VLLM_DELAY": "0", "FAKE_VLLM_ROUTING": "full",
           "FAKE_VLLM_MOE": f"{LAYERS},{TOP_K},{EXPERTS}"}  # fmt: skip
    command = [sys.executable, str(TESTS / "fake_cluster" / "fake_vllm_server.py"), "vllm-serve", "--model",
               "tiny-moe", "--host", "127.0.0.1", "--port", str(port), fake.ROUTING_FLAG]  # fmt: skip
    server = processes.popen(command, env=env, stdout=processes.DEVNULL, stderr=processes.DEVNULL,
                             preexec_fn=functools.partial(die_with, os.getpid()))  # fmt: skip
    try:
        yield
    finally:
        processes.kill_group(server)
        server.wait()


def trl_server_mode_on_cpu() -> None:
    """TRL's server mode without vllm installed, its weight sync (NCCL) off: not what this run is about."""
    from trl.generation import vllm_client, vllm_generation

    import dhpo_trl.training.vllm_utils as vllm_utils

    for module in (vllm_client, vllm_generation, vllm_utils):
        module.is_vllm_available = lambda *a, **k: True
    vllm_client.VLLMClient.init_communicator = lambda self, device=0: None
    # the parameters are still walked: under ZeRO-3 every rank takes part in each one's gather
    vllm_client.VLLMClient.update_named_params = lambda self, metadata, params: [None for _ in params]
    vllm_client.VLLMClient.reset_prefix_cache = lambda self: None


def planted(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(tokens, layers, top_k) experts the fake server routed these tokens (ids, positions in a sequence) through."""
    return torch.tensor([[fake.planted_experts(t, p, layer, TOP_K, EXPERTS) for layer in range(LAYERS)]
                         for t, p in zip(ids.tolist(), positions.tolist())]).view(-1, LAYERS, TOP_K)  # fmt: skip


class PlantedSpy:
    """Every decoder forward of `model`: the tokens it routed (ids and positions in their sequence, from its padded
    inputs) and what each layer's experts block was given, in call order (gradient checkpointing runs each layer
    again in the backward, after the decoder's forward ended: those calls land on the forward they recompute)."""

    def __init__(self, model):
        self.forwards = []
        decoder = model.get_decoder()
        self.handles = [decoder.register_forward_pre_hook(self._start, with_kwargs=True)]
        blocks = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
        for layer, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(
                lambda m, args, layer=layer: self.forwards[-1]["used"].append((layer, args[1].detach().clone()))))

    def _start(self, module, args, kwargs):
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        where = mask.flatten().bool()
        positions = (torch.cumsum(mask.long(), 1) - 1).flatten()[where]
        self.forwards.append({"ids": ids.flatten()[where], "positions": positions, "where": where, "used": [],
                              "sequences": [row[m.bool()].tolist() for row, m in zip(ids, mask)]})  # fmt: skip

    def summary(self) -> dict:
        """Forwards, recomputed ones, token-layer decisions checked and those that differ from the planted ones."""
        decisions = differing = recomputed = 0
        for forward in self.forwards:
            want = planted(forward["ids"], forward["positions"]).sort(-1).values
            recomputed += len(forward["used"]) > LAYERS
            for layer, used in forward["used"]:
                got = used[forward["where"]].sort(-1).values
                decisions += got.size(0)
                differing += int((got != want[:, layer]).any(-1).sum())
        sequences = sorted({tuple(s) for forward in self.forwards for s in forward["sequences"]})
        return {"forwards": len(self.forwards), "recomputed": recomputed, "decisions": decisions,
                "differing": differing, "sequences": [list(s) for s in sequences]}  # fmt: skip


def rollout_run(out_dir: Path, tok, zero3: bool, port: int) -> None:
    """R3 through the fake server: every forward of this rank against the planted routing of its own tokens."""
    trl_server_mode_on_cpu()
    model = build_tiny_qwen3(tok, moe=True, seed=0)
    args = config(out_dir / "rollout", zero3, routing_replay="rollout", use_vllm=True, vllm_mode="server",
                  vllm_server_host="127.0.0.1", vllm_server_port=port, vllm_server_timeout=120)  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [f"{a}*{a}=" for a in range(16)]})
    trainer = DHPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tok)
    spy, start = PlantedSpy(trainer.model), time.perf_counter()
    try:
        trainer.train()
    finally:
        for handle in spy.handles:
            handle.remove()
    logs = [e for e in trainer.state.log_history if "moe/routing_flip_fraction" in e]
    rank = trainer.accelerator.process_index
    (out_dir / f"rollout_rank{rank}.json").write_text(json.dumps({
        **spy.summary(), "flip": [e["moe/routing_flip_fraction"] for e in logs],
        "replayed": [e["moe/replayed_fraction"] for e in logs], "train_s": time.perf_counter() - start,
    }))  # fmt: skip


def recorded_run(out_dir: Path, tok, zero3: bool) -> None:
    """R2: every policy pass of this rank against its micro-batch's recorded routing (`CheckingTrainer`)."""
    model = build_tiny_qwen3(tok, moe=True, seed=0)  # before the config: a ZeRO-3 config switches construction
    args = config(out_dir / "run", zero3, routing_replay="old")
    dataset = Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(16)]})
    trainer = CheckingTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                              processing_class=tok)  # fmt: skip
    trainer.train()
    logs = [e for e in trainer.state.log_history if "moe/routing_flip_fraction" in e]
    rank = trainer.accelerator.process_index
    (out_dir / f"rank{rank}.json").write_text(json.dumps({
        "checked": CheckingTrainer.checked, "differing": CheckingTrainer.differing,
        "flip": [e["moe/routing_flip_fraction"] for e in logs], "replayed": [e["moe/replayed_fraction"] for e in logs],
        "zero3": residency(model),
    }))  # fmt: skip


def main() -> None:
    torch.set_num_threads(1)
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer()
    zero3 = "--zero3" in sys.argv
    port = int(sys.argv[sys.argv.index("--rollout-port") + 1]) if "--rollout-port" in sys.argv else None
    with fake_server(port, out_dir / "fake_vllm_log"):  # started first: it boots while the R2 run trains
        recorded_run(out_dir, tok, zero3)
        if port is not None:
            rollout_run(out_dir, tok, zero3, port)


if __name__ == "__main__":
    main()
    release_process_groups()
