"""R3 (`routing_replay="rollout"`): the experts vLLM routed each token through, carried from vLLM to the trainer's
batch, in server mode (its reply) or colocated (the offline engine's outputs).

A vLLM server started with `--enable-return-routed-experts` adds to each `/v1/completions` reply the routing of every
token: `routed_experts` on each choice (its completion tokens) and `prompt_routed_experts` for the prompt (on the
reply, one per prompt, shared by its n choices; on the choice where a server puts it there), each (tokens, MoE
layers, top_k) int16, as nested lists or as {"data": base64, "shape": [...]}. TRL's client keeps only the token ids
and log-probs; `RolloutRouting.install` wraps the client's `_post` on the main process to keep the routing too (TRL
is not changed), and TRL's `generate` to hand each process the routing of its own completions, like TRL's slice.

Colocated, TRL builds `LLM(...)` itself: `colocated_engine_returns_routing` adds `enable_return_routed_experts=True`
to that call (by the name TRL's module calls), and `install` wraps the engine's `generate` to keep the routing of
its `RequestOutput`s (`prompt_routed_experts`, each completion's `routed_experts`).

The routing of a completion's last token may be missing (vLLM never feeds the last sampled token back through the
model): it is filled with its predecessor's; the last token's output feeds no scored log-prob.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import urllib.error
import urllib.request

import numpy as np
import torch

from .routing_replay import Routing, prefix_keys

SERVER_FLAG = "--enable-return-routed-experts"
_COMPLETIONS = "/v1/completions"


def decode_experts(value, what: str) -> np.ndarray:
    """One routing field as a (tokens, layers, top_k) int16 array: nested lists or {"data": base64, "shape"}."""
    if isinstance(value, dict) and "data" in value and "shape" in value:
        raw = np.frombuffer(base64.b64decode(value["data"]), dtype=np.dtype(value.get("dtype", "int16")))
        array = raw.reshape([int(n) for n in value["shape"]])
    elif isinstance(value, list):
        array = np.asarray(value) if value else np.zeros((0, 0, 0), np.int16)  # a completion cut before any step
    elif isinstance(value, np.ndarray) or torch.is_tensor(value):  # the offline engine's outputs
        array = np.asarray(value.cpu() if torch.is_tensor(value) else value)
    else:
        raise ValueError(f"rollout routing: {what} is {type(value).__name__}, not a (tokens, layers, top_k) array: "
                         f"start the vLLM server with {SERVER_FLAG}")  # fmt: skip
    if array.ndim != 3 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"rollout routing: {what} has shape {array.shape} ({array.dtype}); it must be (tokens, "
                         "layers, top_k) integers")  # fmt: skip
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np.int16).max):
        raise ValueError(f"rollout routing: {what} holds expert {int(array.min())}..{int(array.max())}, outside int16")
    return array.astype(np.int16)


def sequence_rows(prompt_ids: list, completion_ids: list, prompt_routing: np.ndarray,
                  completion_routing: np.ndarray, where: str) -> np.ndarray:  # fmt: skip
    """The (prompt + completion tokens, layers, top_k) routing of one sample; ValueError naming the shapes where the
    routing does not cover its tokens (a truncated reply, another model)."""
    if prompt_routing.shape[0] != len(prompt_ids):
        raise ValueError(f"rollout routing of {where}: prompt_routed_experts {prompt_routing.shape} for a prompt of "
                         f"{len(prompt_ids)} tokens")  # fmt: skip
    rows, need = completion_routing.shape[0], len(completion_ids)
    if need and rows == need - 1 and rows:  # the last sampled token never went through the model
        completion_routing = np.concatenate([completion_routing, completion_routing[-1:]])
    elif need and rows == need - 1 and prompt_routing.shape[0]:
        completion_routing = prompt_routing[-1:]
    elif rows != need:
        raise ValueError(f"rollout routing of {where}: routed_experts {completion_routing.shape} for a completion of "
                         f"{need} tokens")  # fmt: skip
    if need and prompt_routing.shape[1:] != completion_routing.shape[1:]:
        raise ValueError(f"rollout routing of {where}: prompt_routed_experts {prompt_routing.shape} and routed_experts "
                         f"{completion_routing.shape} differ in (layers, top_k)")  # fmt: skip
    return np.concatenate([prompt_routing, completion_routing]) if need else prompt_routing


def _depth(value) -> int:
    """Nesting depth of a list along its first elements (bounded by the value's own nesting)."""
    depth = 0
    while isinstance(value, list):
        depth += 1
        value = value[0] if value else None
    return depth


def reply_samples(reply: dict, prompts: list, n: int) -> list:
    """(token ids, (tokens, layers, top_k) routing) of every choice of a `/v1/completions` reply, in its order
    (prompt-major, as TRL reads the choices)."""
    choices = reply.get("choices") or []
    if len(choices) != len(prompts) * n:
        raise ValueError(f"rollout routing: the reply holds {len(choices)} choices for {len(prompts)} prompts x n={n}")
    shared = reply.get("prompt_routed_experts")
    if shared is not None and len(prompts) == 1 and (isinstance(shared, dict) or _depth(shared) == 3):
        shared = [shared]  # one prompt: the reply's field is that prompt's array
    samples = []
    for index, choice in enumerate(choices):
        prompt = index // n
        if "routed_experts" not in choice or choice["routed_experts"] is None:
            raise ValueError(f"rollout routing: choice {index} of the vLLM reply carries no routed_experts: start the "
                             f"server with {SERVER_FLAG}")  # fmt: skip
        own = choice.get("prompt_routed_experts")
        if own is None and (shared is None or len(shared) != len(prompts)):
            raise ValueError(f"rollout routing: the vLLM reply carries no prompt_routed_experts for prompt {prompt}: "
                             f"start the server with {SERVER_FLAG}")  # fmt: skip
        prompt_routing = decode_experts(own if own is not None else shared[prompt], f"prompt_routed_experts[{prompt}]")
        completion_routing = decode_experts(choice["routed_experts"], f"choices[{index}].routed_experts")
        prompt_ids = list(choice.get("prompt_token_ids") or prompts[prompt])
        completion_ids = list(choice["token_ids"])
        rows = sequence_rows(prompt_ids, completion_ids, prompt_routing, completion_routing, f"choice {index}")
        samples.append((prompt_ids + completion_ids, rows))
    return samples


def output_samples(outputs: list) -> list:
    """(token ids, routing) of every completion of the offline engine's `generate` outputs, in TRL's order."""
    samples = []
    for index, request in enumerate(outputs):
        prompt_ids, prompt_routing = list(request.prompt_token_ids), getattr(request, "prompt_routed_experts", None)
        for output in request.outputs:
            routing = getattr(output, "routed_experts", None)
            if routing is None or prompt_routing is None:
                raise ValueError(f"rollout routing: request {index} of the colocated vLLM engine carries no routing "
                                 "(the engine was built without enable_return_routed_experts=True)")  # fmt: skip
            completion_ids = list(output.token_ids)
            rows = sequence_rows(prompt_ids, completion_ids, decode_experts(prompt_routing, "prompt_routed_experts"),
                                 decode_experts(routing, "routed_experts"), f"request {index}")  # fmt: skip
            samples.append((prompt_ids + completion_ids, rows))
    return samples


@contextlib.contextmanager
def colocated_engine_returns_routing(args):
    """While TRL builds its colocated engine: `routing_replay="rollout"` adds enable_return_routed_experts=True."""
    from trl.generation import vllm_generation

    build = getattr(vllm_generation, "LLM", None)  # absent without vllm: TRL then raises its own error
    active = args.routing_replay == "rollout" and args.use_vllm and args.vllm_mode == "colocate" and build is not None
    if active:
        vllm_generation.LLM = functools.partial(build, enable_return_routed_experts=True)
    try:
        yield
    finally:
        if active:
            vllm_generation.LLM = build


def routing_of(samples: list) -> Routing:
    """A `Routing` keyed like the trainer's forwards over these sequences (the keys of their padded rows)."""
    if not samples:
        raise ValueError("rollout routing: no routed sample to replay (the generation returned nothing)")
    ids = torch.tensor([token for tokens, _ in samples for token in tokens], dtype=torch.long)
    lengths = torch.tensor([len(tokens) for tokens, _ in samples])
    segment = torch.repeat_interleave(torch.arange(len(samples)), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(ids.numel()) - starts[segment]
    keys, checks = prefix_keys(ids, positions, segment)
    experts = torch.from_numpy(np.concatenate([rows for _, rows in samples])).permute(1, 0, 2).contiguous()
    return Routing(keys, checks, experts)


def server_routing_reason(base_url: str, timeout_s: float = 10.0) -> str | None:
    """Why the server at `base_url` returns no routing (None: its config has enable_return_routed_experts on)."""
    try:
        with urllib.request.urlopen(f"{base_url}/server_info?config_format=json", timeout=timeout_s) as answer:
            info = json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return f"its /server_info answers {error.code} (vLLM serves it in dev mode: start it with `trl vllm-serve`)"
    except (urllib.error.URLError, OSError, ValueError) as error:
        return f"its /server_info could not be read ({error})"

    def find(node):
        if isinstance(node, dict):
            if "enable_return_routed_experts" in node:
                return bool(node["enable_return_routed_experts"])
            return any(find(value) for value in node.values())
        return any(find(value) for value in node) if isinstance(node, list) else False

    return None if find(info) else "it was started without returning routing"


class RolloutRouting:
    """The routing of the generation batch being built, on every process: `install` on TRL's `VLLMGeneration`,
    `take()` once per generation batch after generation."""

    def __init__(self):
        self._captured: list = []  # main process: samples of the replies since the last generate()
        self._local: list = []  # this process's samples, in TRL's completion order

    def install(self, generation, accelerator) -> None:
        colocated = generation.mode == "colocate"
        if colocated:
            engine_generate = generation.llm.generate

            def generate_and_keep(*args, **kwargs):
                outputs = engine_generate(*args, **kwargs)
                self._captured += output_samples(outputs)
                return outputs

            generation.llm.generate = generate_and_keep
        client = getattr(generation, "vllm_client", None)
        if not colocated and client is not None:  # the main process talks to the server
            post = client._post

            def post_and_keep(url, **kwargs):
                reply = post(url, **kwargs)
                if url.endswith(_COMPLETIONS):
                    body = kwargs.get("json") or {}
                    self._captured += reply_samples(reply, body.get("prompt") or [], int(body.get("n", 1)))
                return reply

            client._post = post_and_keep
        generate = generation.generate

        def generate_and_slice(prompts, *args, **kwargs):
            self._captured = []
            result = generate(prompts, *args, **kwargs)
            if colocated:  # this process's engine (TRL: its tensor-parallel group's prompts, this rank's share)
                every = self._captured
                tensor_parallel = getattr(generation, "tensor_parallel_size", 1) > 1
                start = torch.distributed.get_rank(group=generation.tp_group) * len(prompts) if tensor_parallel else 0
            else:  # the main process's reply, every process's completions (TRL's broadcast, then its slice)
                from accelerate.utils import broadcast_object_list

                held = [self._captured if accelerator.is_main_process else None]
                if accelerator.num_processes > 1:
                    broadcast_object_list(held, from_process=0)
                every, start = held[0], accelerator.process_index * len(prompts)
            self._captured = []
            self._local += every[start : start + len(prompts)]
            return result

        generation.generate = generate_and_slice

    def take(self) -> Routing:
        samples, self._local = self._local, []
        return routing_of(samples)
