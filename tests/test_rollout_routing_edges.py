"""R3's routing read from malformed replies and engine outputs (`dhpo_trl/training/rollout_routing.py`): each is a
ValueError that names the field, the choice or request, and the setting that fixes it. Also the hooks `install` puts
on TRL's backend, with stand-ins for its server client, its colocated engine and accelerate's broadcast."""

from types import SimpleNamespace

import numpy as np
import pytest

from dhpo_trl.training.rollout_routing import SERVER_FLAG, RolloutRouting, output_samples, reply_samples


def experts(tokens, layers=2, offset=0):
    return [[[(i + j + offset) % 7, (i + j + offset + 1) % 7] for j in range(layers)] for i in range(tokens)]


def request(prompt_routing, routing, prompt=(1, 2), completion=(3,)):
    return SimpleNamespace(prompt_token_ids=list(prompt), prompt_routed_experts=prompt_routing,
                           outputs=[SimpleNamespace(token_ids=list(completion), routed_experts=routing)])  # fmt: skip


@pytest.mark.parametrize("missing", ["prompt_routed_experts", "routed_experts"])
def test_an_engine_output_without_the_routing_attribute_names_the_engine_setting(missing):
    """An engine built without the option returns outputs without the attributes at all (not set to None)."""
    output = request(np.array(experts(2), np.int16), np.array(experts(1), np.int16))
    if missing == "prompt_routed_experts":
        del output.prompt_routed_experts
    else:
        del output.outputs[0].routed_experts
    with pytest.raises(ValueError, match=r"request 0 .*enable_return_routed_experts=True"):
        output_samples([output])


def test_a_malformed_engine_routing_names_its_field_and_request():
    good = request(np.array(experts(2), np.int16), np.array(experts(1), np.int16))
    flat_prompt = request(np.zeros((2, 2), np.int16), np.array(experts(1), np.int16))
    with pytest.raises(ValueError, match=r"^rollout routing: prompt_routed_experts has shape \(2, 2\)"):
        output_samples([good, flat_prompt])
    flat_completion = request(np.array(experts(2), np.int16), np.zeros((1, 2), np.int16))
    with pytest.raises(ValueError, match=r"^rollout routing: routed_experts has shape \(1, 2\)"):
        output_samples([good, flat_completion])
    short = request(np.array(experts(2), np.int16), np.array(experts(1), np.int16), completion=(3, 4, 5))
    with pytest.raises(ValueError, match=r"^rollout routing of request 1: routed_experts \(1, 2, 2\) for a completion "
                                         r"of 3 tokens"):  # fmt: skip
        output_samples([good, short])


def test_a_reply_with_another_number_of_choices_names_both_counts():
    choices = [{"token_ids": [6], "routed_experts": experts(1), "prompt_routed_experts": experts(2)}] * 3
    with pytest.raises(ValueError, match=r"3 choices for 2 prompts x n=2"):
        reply_samples({"choices": choices}, [[1, 2], [3, 4]], 2)


def test_one_prompt_with_an_empty_prompt_routing_names_the_server_flag():
    reply = {"choices": [{"token_ids": [6], "routed_experts": experts(1)}], "prompt_routed_experts": []}
    with pytest.raises(ValueError, match=f"no prompt_routed_experts for prompt 0.*{SERVER_FLAG}"):
        reply_samples(reply, [[1, 2]], 1)


def test_a_malformed_reply_routing_names_its_field_with_the_prompt_or_choice():
    prompts = [[1, 2], [3, 4]]
    choices = [{"token_ids": [6], "routed_experts": experts(1)} for _ in range(4)]
    reply = {"choices": choices, "prompt_routed_experts": [experts(2), [[1, 2], [3, 4]]]}
    with pytest.raises(ValueError, match=r"^rollout routing: prompt_routed_experts\[1\] has shape \(2, 2\)"):
        reply_samples(reply, prompts, 2)
    reply["prompt_routed_experts"][1] = experts(2)
    choices[2]["routed_experts"] = [[1, 2]]
    with pytest.raises(ValueError, match=r"^rollout routing: choices\[2\]\.routed_experts has shape \(1, 2\)"):
        reply_samples(reply, prompts, 2)


def test_the_choices_prompt_token_ids_stand_for_a_prompt_sent_as_text():
    """A request whose prompts are text: the token ids come from the choice (the server's tokenisation)."""
    choices = [{"prompt_token_ids": [1, 2], "token_ids": [6], "routed_experts": experts(1),
                "prompt_routed_experts": experts(2)}]  # fmt: skip
    samples = reply_samples({"choices": choices}, ["2+2="], 1)
    assert samples[0][0] == [1, 2, 6] and samples[0][1].tolist() == experts(2) + experts(1)


def test_decode_reads_the_wire_dtype_empty_lists_and_tensors_and_refuses_experts_outside_int16():
    import base64

    import torch

    from dhpo_trl.training.rollout_routing import decode_experts, sequence_rows

    value = np.array(experts(3), dtype=np.int32)
    wire = {"data": base64.b64encode(value.tobytes()).decode(), "shape": list(value.shape), "dtype": "int32"}
    assert decode_experts(wire, "x").tolist() == experts(3)
    empty = decode_experts([], "x")  # a completion of one sampled token: no step went through the model
    assert empty.shape == (0, 0, 0) and empty.dtype == np.int16
    prompt = np.asarray(experts(3), dtype=np.int16)
    rows = sequence_rows([1, 2, 3], [7], prompt, empty, "sample 0")
    assert rows.tolist() == experts(3) + experts(3)[-1:]
    assert decode_experts(torch.tensor(experts(2)), "x").tolist() == experts(2)
    with pytest.raises(ValueError, match=r"^rollout routing: x is str, not a \(tokens, layers, top_k\) array"):
        decode_experts("routing", "x")
    with pytest.raises(ValueError, match=r"^rollout routing: x holds expert -1\.\.3, outside int16"):
        decode_experts([[[-1, 3]]], "x")
    with pytest.raises(ValueError, match=r"^rollout routing: x holds expert 0\.\.32768, outside int16"):
        decode_experts([[[0, 32768]]], "x")
    assert decode_experts([[[0, 32767]]], "x").tolist() == [[[0, 32767]]]  # the largest int16 is an expert


def test_a_one_token_completion_without_routing_takes_the_prompts_last_row():
    from dhpo_trl.training.rollout_routing import sequence_rows

    prompt = np.array(experts(3), np.int16)
    rows = sequence_rows([5, 6, 7], [8], prompt, np.zeros((0, 2, 2), np.int16), "choice 0")
    assert rows.tolist() == experts(3) + experts(3)[-1:]
    with pytest.raises(ValueError, match=r"^rollout routing of choice 0: prompt_routed_experts \(3, 2, 2\) and "
                                         r"routed_experts \(1, 3, 2\) differ in \(layers, top_k\)"):  # fmt: skip
        sequence_rows([5, 6, 7], [8], prompt, np.array(experts(1, layers=3), np.int16), "choice 0")
    assert sequence_rows([5, 6, 7], [], prompt, np.zeros((0, 2, 2), np.int16), "choice 0").tolist() == experts(3)


def test_no_sample_to_replay_is_said():
    from dhpo_trl.training.rollout_routing import routing_of

    with pytest.raises(ValueError, match=r"^rollout routing: no routed sample to replay"):
        routing_of([])


# ------------------------------------------------------------------ the hooks on TRL's backend
def completion(index: int) -> list[int]:
    return [20 + index, 30 + index]


def server_reply(prompts, n, first=0):
    """Choices numbered from `first`: the choice index within the whole generation batch."""
    choices = [{"token_ids": completion(first + i), "routed_experts": experts(2, offset=first + i)}
               for i in range(len(prompts) * n)]  # fmt: skip
    return {"choices": choices, "prompt_routed_experts": [experts(len(p), offset=3) for p in prompts]}


class Server:
    """TRL's server mode on the main process: `generate` posts each chunk of unique prompts to /v1/completions (and
    reads another endpoint first); `body_n=False` leaves `n` out of the request (one choice per prompt)."""

    mode = "server"

    def __init__(self, prompts, n, chunks=1, body_n=True):
        self.prompts, self.n, self.chunks, self.body_n = prompts, n, chunks, body_n
        self.vllm_client = SimpleNamespace(_post=self.post)

    def post(self, url, json=None):
        if url.endswith("/get_world_size/"):
            return {"world_size": 1}
        return server_reply(json["prompt"], json.get("n", 1), self.prompts.index(json["prompt"][0]) * self.n)

    def generate(self, prompts, *args, **kwargs):
        self.vllm_client._post("http://server/get_world_size/")
        size = len(self.prompts) // self.chunks
        for start in range(0, len(self.prompts), size):
            body = {"prompt": self.prompts[start : start + size], **({"n": self.n} if self.body_n else {})}
            self.vllm_client._post("http://server/v1/completions", json=body)
        return prompts


def broadcast_from(sent: dict):
    """accelerate's `broadcast_object_list` between two processes: the list of `from_process` (kept in `sent` when
    that process calls it) replaces the caller's."""

    def broadcast(held, from_process=0):
        if from_process not in sent:
            raise AssertionError(f"broadcast from process {from_process!r}, which sent nothing")
        held[:] = sent[from_process]
        return held

    return broadcast


def accelerator(index, processes=2):
    return SimpleNamespace(process_index=index, num_processes=processes, is_main_process=index == 0)


def test_every_process_keeps_its_share_of_the_main_processs_replies(monkeypatch):
    """Two processes, two prompts x n=2 in two requests: the main process captures both replies; process 1, which has
    no client, receives them through the broadcast from process 0 and keeps choices 2-3."""
    import accelerate.utils

    prompts = [[1, 2], [3, 4, 5]]
    main = Server(prompts, 2, chunks=2)
    ours = RolloutRouting()
    ours.install(main, accelerator(0))
    sent = {}

    def record_and_broadcast(held, from_process=0):
        sent[0] = list(held)
        return held

    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", record_and_broadcast)
    main.generate([prompts[0]] * 2)
    other = SimpleNamespace(mode="server", generate=lambda prompts, *args, **kwargs: prompts)  # no vllm_client
    theirs = RolloutRouting()
    theirs.install(other, accelerator(1))
    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", broadcast_from(sent))
    other.generate([prompts[1]] * 2)
    assert [ids for ids, _ in ours._local] == [prompts[0] + completion(0), prompts[0] + completion(1)]
    assert [ids for ids, _ in theirs._local] == [prompts[1] + completion(2), prompts[1] + completion(3)]
    assert theirs._local[0][1][-2:].tolist() == experts(2, offset=2)


def test_a_request_without_n_is_one_choice_per_prompt():
    prompts = [[1, 2], [3, 4, 5]]
    server = Server(prompts, 1, body_n=False)
    source = RolloutRouting()
    source.install(server, accelerator(0, processes=1))
    server.generate(prompts)
    assert [ids for ids, _ in source._local] == [prompts[0] + completion(0), prompts[1] + completion(1)]


def test_generation_batches_accumulate_until_taken():
    prompts = [[1, 2]]
    server = Server(prompts, 1)
    source = RolloutRouting()
    source.install(server, accelerator(0, processes=1))
    server.generate(prompts)
    server.generate(prompts)
    assert len(source._local) == 2
    source.take()
    assert source._local == []


class Engine:
    """vLLM's offline engine as TRL's colocate mode calls it, returning routing; records the keyword arguments."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, **kwargs):
        self.calls.append(kwargs)
        return [request(np.array(experts(len(p), offset=3), np.int16), np.array(experts(2, offset=index), np.int16),
                        prompt=p, completion=completion(index)) for index, p in enumerate(prompts)]  # fmt: skip


class Colocated:
    """TRL's colocate mode: every process has its engine; under tensor parallelism the engine generates for the
    prompts of every process of its group, in rank order, each process keeping its own slice."""

    mode = "colocate"

    def __init__(self, group_prompts, **attributes):
        self.llm, self.group_prompts = Engine(), group_prompts
        self.__dict__.update(attributes)

    def generate(self, prompts, *args, **kwargs):
        for start in range(0, len(self.group_prompts), 2):  # two engine calls for one generate
            self.llm.generate(self.group_prompts[start : start + 2], sampling_params={"n": 1}, use_tqdm=False)
        return prompts


@pytest.mark.parametrize("tensor_parallel", [None, 1, 2])
def test_a_colocated_process_keeps_its_slice_of_its_engines_outputs(monkeypatch, tensor_parallel):
    """Tensor parallel 2: this process is rank 1 of its group (rank 3 of the world) and keeps the second half of the
    group's outputs; without tensor parallelism (the attribute absent, or 1) it keeps every output of its engine."""
    import torch.distributed

    group = object()
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1 if group is tp_group else 3)
    tp_group = group
    prompts = [[1, 2], [3, 4], [5, 6], [7, 8]]
    attributes = {} if tensor_parallel is None else {"tensor_parallel_size": tensor_parallel, "tp_group": group}
    generation = Colocated(prompts, **attributes)
    source = RolloutRouting()
    source.install(generation, accelerator(3, processes=4))
    own = prompts[2:] if tensor_parallel == 2 else prompts
    generation.generate(own)
    indices = [2, 3] if tensor_parallel == 2 else [0, 1, 2, 3]
    # the engine numbers its requests per call: two calls of two prompts
    assert [ids for ids, _ in source._local] == [prompts[i] + completion(i % 2) for i in indices]
    assert all(call == {"sampling_params": {"n": 1}, "use_tqdm": False} for call in generation.llm.calls)


# ------------------------------------------------------------------ the server's config, read before training
@pytest.fixture
def server_info():
    """A local HTTP server whose /server_info answers what the test puts in `answers["body"]` (bytes, or an int: that
    HTTP error status); yields (base URL, answers)."""
    import http.server
    import threading

    answers = {"body": b"{}", "paths": []}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            answers["paths"].append(self.path)
            body = answers["body"]
            if isinstance(body, int):
                self.send_error(body)
                return
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", answers
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize(("config", "returns_routing"), [
    ({"model_config": {"enable_return_routed_experts": True}}, True),
    ({"engines": [{"other": 1}, {"model_config": {"enable_return_routed_experts": 1}}]}, True),
    ({"model_config": {"enable_return_routed_experts": False}}, False),
    ({"model_config": {"max_model_len": 8}, "flags": [1, "x"]}, False),
])  # fmt: skip
def test_the_servers_config_is_searched_for_the_routing_flag(server_info, config, returns_routing):
    import json

    from dhpo_trl.training.rollout_routing import server_routing_reason

    base, answers = server_info
    answers["body"] = json.dumps(config).encode()
    reason = server_routing_reason(base)
    assert (reason is None) is returns_routing
    assert answers["paths"] == ["/server_info?config_format=json"]


def test_a_server_that_cannot_tell_is_named_with_its_answer(server_info):
    import socket

    from dhpo_trl.training.rollout_routing import server_routing_reason

    base, answers = server_info
    answers["body"] = 404
    assert "404" in server_routing_reason(base) and "/server_info" in server_routing_reason(base)
    answers["body"] = b"not json"
    assert "/server_info" in server_routing_reason(base)
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    assert "/server_info" in server_routing_reason(f"http://127.0.0.1:{closed}", timeout_s=2.0)


def test_a_server_that_never_answers_is_given_up_at_the_timeout():
    """A server that accepts the connection and never answers: the check returns a reason at its timeout instead of
    holding the trainer's start (run in a thread, so that a check without a timeout fails here instead of hanging)."""
    import socket
    import threading

    from dhpo_trl.training.rollout_routing import server_routing_reason

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # the kernel completes the connection; nothing reads or answers it
        result = []
        thread = threading.Thread(target=lambda: result.append(server_routing_reason(
            f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.5)), daemon=True)  # fmt: skip
        thread.start()
        thread.join(30.0)
        assert not thread.is_alive() and "/server_info" in result[0]


def test_an_empty_prompt_or_completion_keeps_the_routing_it_has():
    """A one-token completion after an empty prompt has no routing to stand in for its token: refused, naming the
    field. An empty completion (cut before any step) is its prompt's rows, whatever shape its empty routing has."""
    from dhpo_trl.training.rollout_routing import sequence_rows

    with pytest.raises(ValueError, match="routed_experts"):
        sequence_rows([], [7], np.zeros((0, 2, 2), np.int16), np.zeros((0, 2, 2), np.int16), "choice 0")
    prompt = np.array(experts(3), np.int16)
    rows = sequence_rows([1, 2, 3], [], prompt, np.zeros((0, 0, 0), np.int16), "choice 1")
    assert rows.tolist() == experts(3)
