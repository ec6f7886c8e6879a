"""`python tests/forked_ranks.py --nproc N [--preload MODULE,...] SCRIPT ARGS...`: SCRIPT run as `__main__` on N ranks with the environment
`torchrun --standalone` gives its workers, each rank forked from this interpreter after it imported the package.

A rank started by torchrun is a new interpreter: it imports torch, transformers, TRL and dhpo_trl again (6-10 s
of CPU each on the 2-core machine), and torchrun itself imports torch. Here the imports happen once, before the
fork, and the ranks share them. Tests whose subject is what the ranks compute use this launcher; those whose
subject is the launch itself (`dhpo-train` under torchrun or accelerate, the release at the end of a run) keep
the real one. A rank runs its script to the end as a process of its own: its own exit status, signal handlers
and interpreter finalisation.

The launcher exits with the first failing rank's status (a rank killed by a signal: 128 + its number) after
stopping the others (SIGTERM, then SIGKILL after a grace period), as torchrun does; 0 when every rank exits 0.
SIGTERM or SIGINT to the launcher is passed to every rank, whose handlers are those of a new interpreter (SIGINT
raises KeyboardInterrupt, so a script's `finally` runs). As torchrun does, OMP_NUM_THREADS is 1 unless set: set
before the imports, it also keeps an OpenMP pool of this process, which a forked child cannot use (libgomp's
workers are not copied and the child waits for them), from being started.
"""

import argparse
import contextlib
import gc
import os
import runpy
import signal
import sys
import time

from processes import free_port  # this folder: sys.path[0] when run as a script

GRACE_SECONDS = 30.0
# What a rank restores: this interpreter's handlers before the launcher installs its own, a new interpreter's.
FORWARDED = (signal.SIGTERM, signal.SIGINT)
INHERITED_HANDLERS = {number: signal.getsignal(number) for number in FORWARDED}
# Imported before the fork. DeepSpeed with its CPU accelerator (`dhpo_trl.demo.tiny.use_deepspeed_on_cpu`, which the
# ZeRO-3 scripts call first themselves): it keeps the accelerator it is first imported with, the CPU one is the only
# one these CPU launches use, and a DDP run does not read it (accelerate picks DeepSpeed from its variables and
# plugin, not from what is imported). Preloaded, a ZeRO-3 rank does not import it again (2-3 s of CPU a rank). The
# trainer is named: `import dhpo_trl` imports its public names on first use, so it would preload none of them.
# Two imports the first step makes lazily, each pulling in torch._dynamo and torch._inductor: DeepSpeed's Muon
# optimizer, which every ZeRO engine imports to check its optimizer (3 s of CPU a ZeRO-3 rank), and torch's
# varlen attention, which the packed path looks for (1 s a rank).
PRELOAD = ("torch", "torch.distributed", "datasets", "transformers", "trl", "dhpo_trl.training.trainer",
           "dhpo_trl.demo.tiny", "dhpo_trl.demo.tiny:use_deepspeed_on_cpu", "deepspeed",
           "deepspeed.runtime.zero.muon.muon_optimizer", "torch.nn.attention.varlen")  # fmt: skip


def rank_environment(rank: int, nproc: int, port: int) -> dict[str, str]:
    """What torchrun's local agent sets for worker `rank` of a standalone single-node launch (rank 0 hosts the
    store, as `init_process_group("env://")` does without an agent's store)."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "forked", "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }  # fmt: skip


def exit_code(status: int) -> int:
    """A wait status as a shell reports it: the exit status, or 128 + the signal that killed the process."""
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def run_rank(rank: int, nproc: int, port: int, script: str, args: list[str]) -> None:
    """In the forked child: the script as `__main__`, as `python SCRIPT ARGS` runs it. Never returns: the script's
    SystemExit (or exception) ends this interpreter, with its finalisation."""
    for number, handler in INHERITED_HANDLERS.items():
        signal.signal(number, handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    os.environ.update(rank_environment(rank, nproc, port))
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def stop(pids: set[int], grace: float) -> None:
    """SIGTERM to every rank still running, then SIGKILL to those left after `grace` seconds."""
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid:
            pids.discard(pid)
        else:
            time.sleep(0.05)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def preload(modules: str) -> None:
    """Import each of the comma-separated `modules`; an entry `module:function` also calls `function()` of it."""
    for entry in filter(None, modules.split(",")):
        module, _, function = entry.partition(":")
        __import__(module)
        if function:
            getattr(sys.modules[module], function)()


def freeze_heap() -> None:
    """The heap built so far (the preloaded imports) moved out of the collector's reach. A rank's full collections
    (accelerate's `free_memory` runs one at the end of every `train()`) then scan what the rank built, not the few
    hundred thousand objects of torch, transformers, TRL and DeepSpeed; and they no longer write to the inherited
    objects' headers, which keeps those pages shared with the parent. Frozen objects are still freed by reference
    counting; `gc.get_objects()` does not list them, and what the release's heap scans look for
    (`dhpo_trl/training/teardown.py`: engines, process groups, partitioned parameters) is created after the fork."""
    gc.collect()
    gc.freeze()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--preload", default=",".join(PRELOAD), help="the modules imported before the fork, by commas")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    if "OMP_NUM_THREADS" not in os.environ and options.nproc > 1:  # torchrun's default, before torch is imported
        os.environ["OMP_NUM_THREADS"] = "1"
    preload(options.preload)
    freeze_heap()
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    running = set()

    def forward(number, frame):
        for pid in running:
            with contextlib.suppress(ProcessLookupError):  # reaped, not yet discarded from `running`
                os.kill(pid, number)

    # Held from before the first fork until every rank is known: a signal that arrives while the ranks start (a
    # rank may already be running its script) is passed on to all of them, not lost with this process.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    for rank in range(options.nproc):
        pid = os.fork()
        if pid == 0:
            run_rank(rank, options.nproc, port, options.script, options.args)
        running.add(pid)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    while running:
        pid, status = os.waitpid(-1, 0)
        running.discard(pid)
        code = exit_code(status)
        if code != 0:
            print(f"forked_ranks: a rank of {options.script} exited with status {code}; stopping the others",
                  file=sys.stderr, flush=True)  # fmt: skip
            stop(running, GRACE_SECONDS)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
