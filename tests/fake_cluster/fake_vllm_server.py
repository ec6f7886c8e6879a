"""A CPU stand-in for `trl vllm-serve`, for the launch-script tests: answers /health and /get_world_size.

tests/fake_cluster/bin/trl runs it as `trl vllm-serve ...`. It parses its arguments with TRL's own `trl vllm-serve`
parser (so the scripts' server command must be valid for it), records them and its environment to
$FAKE_CLUSTER_LOG/server.json (its pid first, to server.pid), then behaves as FAKE_VLLM_MODE says, after
FAKE_VLLM_DELAY seconds:
  ok      answers /health with 200 and /get_world_size with {"world_size": TP x DP}, like vLLM's dev-mode server;
  die     prints a CUDA error and exits with status 1, like a server that fails while loading;
  silent  keeps answering /health with 503, like a server that never finishes loading.
FAKE_VLLM_WORLD_SIZE, if set, replaces TP x DP in /get_world_size; `none` makes it 404, like vLLM without dev mode.
"""

import json
import os
import sys
import time
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


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

    server = ThreadingHTTPServer((args.host, args.port), _handler(world_size, ready_at=time.time() + delay, mode=mode))
    if mode == "die":
        time.sleep(delay)
        print("RuntimeError: CUDA out of memory (fake vLLM server)", file=sys.stderr, flush=True)
        with open(os.path.join(log_dir, "server_died_at"), "w") as handle:
            handle.write(str(time.time()))
        sys.exit(1)
    server.serve_forever()


def _handler(world_size: int, ready_at: float, mode: str):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            path = self.path.rstrip("/")
            ready = mode == "ok" and time.time() >= ready_at
            if path == "/health":
                self._answer(200 if ready else 503, {})
            elif path == "/get_world_size" and ready and world_size != "none":
                self._answer(200, {"world_size": int(world_size)})
            else:
                self._answer(404, {})

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
