"""Early checks of a vLLM setup, run by `DHPOTrainer` before any model is loaded.

TRL raises the same kinds of errors, but only after loading the policy (and reference) model, and its server check
points to `vllm serve` rather than to `trl vllm-serve`, which is the server TRL's client talks to. These checks fail
in seconds with the command that fixes the problem.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from urllib.parse import urlparse

from trl.import_utils import is_vllm_available

# dhpo-trl is not on PyPI: install the extra from a clone of the repository.
VLLM_INSTALL_HINT = 'pip install -e ".[vllm]"'
# Per-attempt timeout of the health probe: a server that is up answers /health at once.
PROBE_TIMEOUT_S = 2.0


def vllm_server_url(args) -> str:
    """The base URL TRL's client will use: `vllm_server_base_url` if set, else http://host:port."""
    if args.vllm_server_base_url:
        return args.vllm_server_base_url.rstrip("/")
    return f"http://{args.vllm_server_host}:{args.vllm_server_port}"


def _server_is_up(base_url: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_for_vllm_server(args, model_name: str, retry_interval_s: float = 2.0) -> None:
    """Poll the server's /health for up to `args.vllm_server_timeout` seconds; ConnectionError if it never answers.

    Waiting (rather than one probe) keeps TRL's behaviour of starting the trainer while the server is still loading.
    """
    base_url = vllm_server_url(args)
    deadline = time.monotonic() + float(args.vllm_server_timeout)
    while True:
        if _server_is_up(base_url, min(PROBE_TIMEOUT_S, max(float(args.vllm_server_timeout), 0.1))):
            return
        if time.monotonic() + retry_interval_s > deadline:
            break
        time.sleep(retry_interval_s)
    port = urlparse(base_url).port or args.vllm_server_port
    where = (
        f"vllm_server_base_url={args.vllm_server_base_url!r}"
        if args.vllm_server_base_url
        else f"host {args.vllm_server_host!r}, port {args.vllm_server_port}"
    )
    raise ConnectionError(
        f"No vLLM server answered at {base_url}/health ({where}) within vllm_server_timeout="
        f"{args.vllm_server_timeout}s. Start it first, on the GPUs not used for training, with:\n"
        f"    trl vllm-serve --model {model_name} --port {port}\n"
        "or point vllm_server_host/vllm_server_port (or vllm_server_base_url) at the running server."
    )


def check_vllm_setup(args, model_name: str, is_main_process: bool = True) -> None:
    """Fail early when `use_vllm=True` cannot work: vllm missing, or (server mode) no server reachable.

    Only the main process talks to the server in TRL, so only it probes (other nodes may not reach the host).
    """
    if not args.use_vllm:
        return
    if not is_vllm_available():
        raise ImportError(
            f"DHPOConfig.use_vllm=True but vllm is not installed. Install it with `{VLLM_INSTALL_HINT}` in a clone "
            "of the dhpo-trl repository (needs a CUDA GPU), or set use_vllm=False to generate with transformers."
        )
    if args.vllm_mode == "server" and is_main_process:
        wait_for_vllm_server(args, model_name)
        if getattr(args, "routing_replay", "none") == "rollout":
            check_server_routing(args, model_name)


def check_server_routing(args, model_name: str) -> None:
    """`routing_replay="rollout"` replays the routing the server returns: refuse a server started without it."""
    from .rollout_routing import SERVER_FLAG, server_routing_reason

    base_url = vllm_server_url(args)
    reason = server_routing_reason(base_url)
    if reason is not None:
        port = urlparse(base_url).port or args.vllm_server_port
        raise ValueError(
            f"DHPOConfig.routing_replay='rollout' replays the routing the vLLM server at {base_url} returns, but "
            f"{reason}. Restart it with {SERVER_FLAG}:\n"
            f"    trl vllm-serve --model {model_name} --port {port} {SERVER_FLAG}\n"
            "or set routing_replay='old' (the pi_old pass's routing)."
        )
