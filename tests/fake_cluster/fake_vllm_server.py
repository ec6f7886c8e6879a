"""A CPU stand-in for `trl vllm-serve`, for the launch-script tests: answers /health and /get_world_size.

tests/fake_cluster/bin/trl runs it as `trl vllm-serve ...`. It parses its arguments with TRL's own `trl vllm-serve`
parser (so the scripts' server command must be valid for it), records them and its environment to
$FAKE_CLUSTER_LOG/server.json (its pid first, to server.pid), then behaves as FAKE_VLLM_MODE says, after
FAKE_VLLM_DELAY seconds:
  ok      answers /health with 200 and /get_world_size with {"world_size": TP x DP}, like vLLM's dev-mode server;
  die     prints a CUDA error and exits with status 1, like a server that fails while loading;
  silent  keeps answering /health with 503, like a server that never finishes loading.
FAKE_VLLM_WORLD_SIZE, if set, replaces TP x DP in /get_world_size; `none` makes it 404, like vLLM without dev mode.

It also answers what TRL's client uses to generate (/v1/models, /server_info, POST /v1/completions), with completions
drawn from a seeded RNG. FAKE_VLLM_MOE="layers,top_k,experts" describes a mixture-of-experts model: started with
--enable-return-routed-experts, its /server_info says so and each reply carries vLLM's routing fields, the planted
`planted_experts` of every token (`routed_experts` per choice, `prompt_routed_experts` per prompt on the reply).
FAKE_VLLM_ROUTING: `full` (default), `drop_last` (no routing for a completion's last token, as vLLM's capturer) or
`short_prompt` (one prompt token too few: a truncated reply).
"""

import json
import os
import random
import sys
import time
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROUTING_FLAG = "--enable-return-routed-experts"


def main() -> None:
    log_dir = os.environ["FAKE_CLUSTER_LOG"]
    with open(os.path.join(log_dir, "server.pid"), "w") as handle:  # first, so that a test can always find it
        handle.write(str(os.getpid()))
    from trl.scripts.vllm_serve import make_parser

    assert sys.argv[1] == "vllm-serve", sys.argv
    args, extra = make_parser(prog="trl vllm-serve").parse_args_and_config(
        args=sys.argv[2:], return_remaining_strings=True
    )
    mode, delay = os.environ.get("FAKE_VLLM_MODE", "ok"), float(os.environ.get("FAKE_VLLM_DELAY", "1"))
    world_size = os.environ.get("FAKE_VLLM_WORLD_SIZE", args.tensor_parallel_size * args.data_parallel_size)
    record = {"args": asdict(args), "extra_args": extra, "env": dict(os.environ)}
    with open(os.path.join(log_dir, "server.json"), "w") as handle:
        json.dump(record, handle)

    moe = [int(n) for n in os.environ["FAKE_VLLM_MOE"].split(",")] if os.environ.get("FAKE_VLLM_MOE") else None
    routing = os.environ.get("FAKE_VLLM_ROUTING", "full") if ROUTING_FLAG in extra else None
    generation = {"model": args.model, "moe": moe, "routing": routing}
    handler = _handler(world_size, ready_at=time.time() + delay, mode=mode, generation=generation)
    server = ThreadingHTTPServer((args.host, args.port), handler)
    if mode == "die":
        time.sleep(delay)
        print("RuntimeError: CUDA out of memory (fake vLLM server)", file=sys.stderr, flush=True)
        with open(os.path.join(log_dir, "server_died_at"), "w") as handle:
            handle.write(str(time.time()))
        sys.exit(1)
    server.serve_forever()


def planted_experts(token: int, position: int, layer: int, top_k: int, experts: int) -> list[int]:
    """The experts the fake server says it routed a token through: distinct, a function of (token, position, layer)."""
    return random.Random(f"{token}|{position}|{layer}").sample(range(experts), top_k)


def _routing(tokens: list, start: int, moe: list) -> list:
    layers, top_k, experts = moe
    return [[planted_experts(t, start + i, layer, top_k, experts) for layer in range(layers)]
            for i, t in enumerate(tokens)]  # fmt: skip


def completions(body: dict, generation: dict) -> dict:
    """A /v1/completions reply for token-id prompts: n choices per prompt, prompt-major, as vLLM orders them."""
    n, max_tokens, choices, prompt_routing = int(body.get("n", 1)), int(body.get("max_tokens", 16)), [], []
    for index, prompt in enumerate(body["prompt"]):
        if generation["routing"]:
            rows = _routing(prompt, 0, generation["moe"])
            prompt_routing.append(rows[:-1] if generation["routing"] == "short_prompt" else rows)
        for sample in range(n):
            rng = random.Random(f"{prompt}|{sample}")  # the same batch again after a resume
            tokens = [rng.randint(3, 40) for _ in range(rng.randint(1, max_tokens))]
            choice = {"index": len(choices), "text": "", "finish_reason": "length", "prompt_token_ids": prompt,
                      "token_ids": tokens, "logprobs": {"tokens": [f"token_id:{t}" for t in tokens],
                                                        "token_logprobs": [-1.0] * len(tokens),
                                                        "top_logprobs": [None] * len(tokens)}}  # fmt: skip
            if generation["routing"]:
                rows = _routing(tokens, len(prompt), generation["moe"])
                choice["routed_experts"] = rows[:-1] if generation["routing"] == "drop_last" else rows
            choices.append(choice)
    reply = {"id": "cmpl-fake", "object": "text_completion", "model": generation["model"], "choices": choices}
    if generation["routing"]:
        reply["prompt_routed_experts"] = prompt_routing
    return reply


def _handler(world_size: int, ready_at: float, mode: str, generation: dict):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            path = self.path.split("?")[0].rstrip("/")
            ready = mode == "ok" and time.time() >= ready_at
            if path == "/health":
                self._answer(200 if ready else 503, {})
            elif path == "/get_world_size" and ready and world_size != "none":
                self._answer(200, {"world_size": int(world_size)})
            elif path == "/v1/models" and ready:
                self._answer(200, {"data": [{"id": generation["model"]}]})
            elif path == "/server_info" and ready:
                config = {"model_config": {"logprobs_mode": "processed_logprobs",
                                           "enable_return_routed_experts": generation["routing"] is not None}}
                self._answer(200, {"vllm_config": config})
            else:
                self._answer(404, {})

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path.rstrip("/") == "/v1/completions":
                self._answer(200, completions(body, generation))
            else:
                self._answer(200, {})

        def _answer(self, status: int, body: dict):
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    return Handler


if __name__ == "__main__":
    main()
