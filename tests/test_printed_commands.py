"""Every command printed in the docs, the recipe and config headers, the launch scripts' usage lines, the training
script's docstring and the benchmarks' docstrings is runnable as written: each one is parsed by the real tool's
parser, and a training command that needs a vLLM server is printed beside that server's command, which must serve it.

Parsers: `accelerate launch`'s own, then `examples/train_dhpo.py`'s (TrlParser + recipe YAMLs + the batch plan for
the launched process count, so 7 processes or a typo'd flag fail here); `trl vllm-serve`'s (TRL's dataclass parser;
it forwards unknown flags to `vllm serve`, which is not importable here, so those must be in VLLM_FLAGS); torchrun's;
the argparse parser of each of our own CLIs and scripts (called up to the parse, not run; flags spelled in full,
and a benchmark's own checks of the parsed options made too, `OPTION_CHECKS` and `CHECKED_UNTIL`). The launch scripts
(`bash`/`sbatch examples/vllm_server/...`) start their own server: their extra arguments are parsed as training
arguments of their recipe, for their process count, and the environment variables set in front of them must be ones
the script reads. Fenced `bash` blocks, indented code blocks and inline commands are read. Text with placeholders
(`<model>`, `...`) is a template, not a command, and is skipped; each command of a benchmark's docstring is a block
of its own (none needs a server beside it), so a template there leaves the others checked, and an optional part
of its synopsis is checked given (`[--budget 30]`) or left out (`[DATA_DIR]`), and the options before a trailing
`...` are checked.
"""

import argparse
import importlib.util
import re
import shlex
import sys
import textwrap
from pathlib import Path

import pytest
from accelerate.commands.launch import _validate_launch_command, launch_command_parser

from dhpo_trl.scale_out.cli import parse_args

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = [
    "README.md",
    "examples/recipes/README.md",
    *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/**/*.md")),
]
HEADERS = sorted(  # files whose leading comment or docstring prints commands
    str(path.relative_to(ROOT))
    for pattern in (
        "examples/recipes/**/*.yaml",
        "accelerate_configs/*.yaml",
        "examples/vllm_server/*.sh",
        "scripts/*.sh",
        "scripts/*.py",
        "examples/train_dhpo.py",
    )  # fmt: skip
    for path in ROOT.glob(pattern)
)
BENCHMARKS = sorted(str(path.relative_to(ROOT)) for path in ROOT.glob("benchmarks/*.py"))  # docstrings print commands
COMMAND_START = re.compile(  # a program, after any VAR=value settings (which may fill a line of their own)
    r"^(?:[A-Z_]+=\S+\s+)*(?:accelerate launch|trl vllm-serve|python3? |torchrun |bash |sbatch |dhpo-\w+|pip install"
    r"|hf download|curl |nvidia-smi)|^(?:[A-Z_]+=\S+\s+)+\\$"
)
INLINE_WHOLE = re.compile(r"^(?:pip install|hf download|curl |nvidia-smi|python3? -c)")
VLLM_FLAGS = {"--enable-expert-parallel"}  # forwarded by `trl vllm-serve` to `vllm serve`
SYS_ARGV_SCRIPTS = ("bench_speed.py", "bench_dynamic_batching.py", "bench_packed_attention.py",
                    "bench_reward_budget.py")  # main() takes no argv
CPU = ["--use_cpu", "true", "--bf16", "false"]  # parse on a machine without GPU; appended last, so they win
OPTION_CHECKS = {  # a benchmark's checks of its parsed options, before it runs: a message or a ValueError fails
    "benchmarks/bench_dynamic_batching.py": "checked_arms",
    "benchmarks/bench_speed.py": "options_error",
    "benchmarks/routing_replay.py": "unused_options",
}
CHECKED_UNTIL = {  # a benchmark whose main checks its options inline: run up to the first call after its checks
    "benchmarks/staleness.py": "plan",
    "benchmarks/study.py": "saved_summary",
}
SCRIPT_RECIPES = {  # the launch scripts' default recipes
    "examples/vllm_server/serve_and_train_single_node.sh": "examples/recipes/dhpo_e_qwen3_1.7b_base.yaml",
    "examples/vllm_server/slurm_multi_node.sh": "examples/recipes/dhpo_e_qwen3_30b_a3b_base.yaml",
}


# ------------------------------------------------------------------ extraction
def _blocks_from_markdown(text):
    for match in re.finditer(r"```(?:bash|sh|shell)\n(.*?)```", text, re.DOTALL):
        yield match.group(1)
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    for indented in re.findall(r"\n\n((?: {4,}\S.*(?:\n|$))+)", prose):  # an indented code block (in a list item)
        block = textwrap.dedent(indented)
        if COMMAND_START.match(block):
            yield block
    for span in re.findall(r"`([^`\n]+)`", prose):
        # a whole command, not a mention of a tool (`trl vllm-serve`) or a flag (`accelerate launch --num_processes`)
        if COMMAND_START.match(span) and (re.search(r"\w/\w|\.(?:py|sh)\b", span) or INLINE_WHOLE.match(span)):
            yield span


def _header_commands(text, path):
    """The commands of a file's comments (YAML, shell) or docstring (Python, as written in the file): each starts on a
    line of its own, indented, and goes on over lines that end in a backslash."""
    if path.endswith(".py"):
        lines = [line.strip() for line in text.split('"""')[1].splitlines()]
    else:
        lines = [line[1:].strip() for line in text.splitlines() if line.startswith("#   ")]
    commands, continued = [], False
    for line in lines:
        if continued:
            commands[-1] += "\n" + line
        elif COMMAND_START.match(line):
            commands.append(line)
        continued = line.endswith("\\") and (continued or COMMAND_START.match(line) is not None)
    return commands


def _blocks_from_header(text, path):
    """A header's commands as one block (a training command and the server it needs are printed together)."""
    commands = _header_commands(text, path)
    if commands:
        yield "\n".join(commands)


def _commands(block):
    """[(environment, argv)] of the commands of one block, joined over `\\` continuations, split at & && ;."""
    commands, current = [], []
    tokens = [
        token for line in block.replace("\\\n", " ").splitlines() for token in shlex.split(line, comments=True) + [";"]
    ]
    for token in tokens:
        if token in ("&", "&&", ";"):
            if current:
                commands.append(current)
            current = []
        else:
            current.append(token)
    result = []
    for argv in commands:
        env = {}
        while re.match(r"^[A-Z_]+=", argv[0]):
            key, value = argv.pop(0).split("=", 1)
            env[key] = value
        result.append((env, argv))
    return result


def all_blocks():
    for name in MARKDOWN:
        for index, block in enumerate(_blocks_from_markdown((ROOT / name).read_text())):
            yield f"{name}#{index}", block
    for name in HEADERS:
        for index, block in enumerate(_blocks_from_header((ROOT / name).read_text(), name)):
            yield f"{name}#{index}", block
    for name in BENCHMARKS:
        for index, command in enumerate(_header_commands((ROOT / name).read_text(), name)):
            yield f"{name}#{index}", _synopsis_as_command(command)


def _synopsis_as_command(command):
    """A usage line's optional options given (`[--budget 30]`), its optional positionals left out (`[DATA_DIR]`), and
    a trailing `...` (more options may follow) dropped: what it does write is checked."""
    command = re.sub(r" \.\.\.(?=\s|$)", "", command)
    return re.sub(r" ?\[[A-Z_]+\]", "", re.sub(r"\[(--\w[^\[\]]*)\]", r"\1", command))


BLOCKS = [  # a block with a placeholder outside its comments is a template
    (where, block)
    for where, block in all_blocks()
    if not re.search(r"<[\w ]+>|\[[A-Z_]+\]|\.\.\.|…", re.sub(r"(^|\s)#.*", "", block))
]


def test_the_extraction_finds_the_commands_that_matter():
    texts = "\n".join(block for _, block in BLOCKS)
    for command in ("accelerate launch", "trl vllm-serve", "sbatch examples/vllm_server/slurm_multi_node.sh",
                    "bash examples/vllm_server/serve_and_train_single_node.sh", "python scripts/memory_estimate.py",
                    "dhpo-evaluate", "pip install -e"):  # fmt: skip
        assert command in texts, command
    assert len(BLOCKS) > 40
    where = {w.split("#")[0] for w, _ in BLOCKS}
    assert {"README.md", "docs/scale_out.md", "examples/recipes/README.md", "examples/train_dhpo.py"} <= where
    assert {f"examples/recipes/dhpo_e_qwen3_{m}_base.yaml" for m in ("1.7b", "4b", "30b_a3b")} <= where
    assert set(BENCHMARKS) <= where and len(BENCHMARKS) >= 9  # every benchmark's docstring prints a command


def test_a_benchmark_synopsis_is_checked_with_its_options_given_and_its_optional_positionals_left_out():
    assert _synopsis_as_command("python b.py [--answers 256] [--budget 30]") == "python b.py --answers 256 --budget 30"
    assert _synopsis_as_command("python b.py [DATA_DIR]   # a comment") == "python b.py   # a comment"
    assert _synopsis_as_command("python b.py --task long ...   # more") == "python b.py --task long   # more"


# ------------------------------------------------------------------ parsers
class _Parsed(Exception):
    pass


def _parse_with_main(main, argv, monkeypatch, *, uses_sys_argv=False, stop_at=None):
    """Run an argparse-based `main` up to its parse: the real parser, without running the program. With `stop_at`
    (module, name), up to its first call of that function instead, so that its checks after the parse run too."""
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        self.allow_abbrev = False  # a printed flag is spelled in full: an abbreviation breaks when a flag is added
        parsed = original(self, args, namespace)
        if stop_at is None:
            raise _Parsed(parsed)
        return parsed

    def stop(*args, **kwargs):
        raise _Parsed(args[0] if args else None)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
        if stop_at is not None:
            patch.setattr(*stop_at, stop)
        if uses_sys_argv:
            patch.setattr(sys, "argv", ["prog", *argv])
        try:
            main() if uses_sys_argv else main(argv)
        except _Parsed as parsed:
            return parsed.args[0]
    raise AssertionError(f"{main} returned without parsing its arguments")


def _load_module(path):
    spec = importlib.util.spec_from_file_location(Path(path).stem + "_cli_under_test", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _load_main(path):
    return _load_module(path).main


def _pyproject_extras():
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _gpu_count(env, name):
    return len(env[name].split(",")) if name in env else None


def check_training(argv, num_processes, env, servers, where):
    """Parse train_dhpo.py's arguments for `num_processes`; a server-mode run needs a matching server beside it."""
    _, config, model = parse_args([*argv, *CPU], num_processes=num_processes)
    if not (config.use_vllm and config.vllm_mode == "server"):
        return
    assert servers, f"{where}: {shlex.join(argv)} needs a vLLM server, and none is printed beside it"
    server = servers[-1]
    assert server["model"] == model.model_name_or_path, f"{where}: the server serves another model"
    assert server["port"] == config.vllm_server_port, f"{where}: the trainer looks for another port"
    host = config.vllm_server_host
    assert host == server["host"] or {host, server["host"]} <= {"127.0.0.1", "localhost"}, f"{where}: host {host}"
    assert config.vllm_server_timeout >= 600, f"{where}: TRL's 240 s default is too short for a first server start"
    train_gpus, server_gpus = env.get("CUDA_VISIBLE_DEVICES"), server["gpus"]
    if train_gpus and server_gpus:
        assert not set(train_gpus.split(",")) & set(server_gpus.split(",")), f"{where}: server and trainer share GPUs"


def check_script(path, env, where):
    text = (ROOT / path).read_text()
    for name in env:
        assert re.search(rf"\${{?{name}\b", text), f"{where}: {path} does not read {name}"
    if path in SCRIPT_RECIPES:  # the checks the scripts make themselves, at start
        tp = int(env.get("SERVER_TP", 4 if "single_node" in path else 1))
        dp = int(env.get("SERVER_DP", 1 if "single_node" in path else 8 // tp))
        server_gpus = len(env.get("SERVER_GPUS", "0,1,2,3").split(",")) if "single_node" in path else 8
        assert tp * dp == server_gpus or ("slurm" in path and 1 <= tp * dp <= 8), f"{where}: SERVER_TP x SERVER_DP"
        recipe = env.get("RECIPE", SCRIPT_RECIPES[path])
        assert (ROOT / env.get("ACCELERATE_CONFIG", "accelerate_configs/zero3.yaml")).is_file()
        return recipe
    return None


def check_python_script(path, argv, monkeypatch, where):
    """Parse `argv` with the script's own parser, and make the checks a benchmark makes on the parsed options."""
    module = _load_module(path)
    stop_at = (module, CHECKED_UNTIL[path]) if path in CHECKED_UNTIL else None
    options = _parse_with_main(module.main, argv, monkeypatch, uses_sys_argv=path.endswith(SYS_ARGV_SCRIPTS),
                               stop_at=stop_at)  # fmt: skip
    if path in OPTION_CHECKS:
        problem = getattr(module, OPTION_CHECKS[path])(options)
        assert not isinstance(problem, str), f"{where}: {problem}"


def check(where, block, monkeypatch):
    servers = []
    for env, argv in _commands(block):
        program, args = argv[0], argv[1:]
        if program == "accelerate":
            assert args[0] == "launch", where
            launch, _, _ = _validate_launch_command(launch_command_parser().parse_args(args[1:]))
            gpus = _gpu_count(env, "CUDA_VISIBLE_DEVICES")
            assert gpus is None or launch.num_machines > 1 or gpus == launch.num_processes, (
                f"{where}: GPUs vs processes"
            )
            if launch.training_script == "examples/train_dhpo.py":
                check_training(launch.training_script_args, launch.num_processes, env, servers, where)
            else:
                _parse_with_main(_load_main(launch.training_script), launch.training_script_args, monkeypatch)
        elif program == "trl":
            from trl.scripts.vllm_serve import make_parser

            assert args[0] == "vllm-serve", where
            served, extra = make_parser(prog="trl vllm-serve").parse_args_and_config(
                args[1:], return_remaining_strings=True
            )
            assert set(extra) <= VLLM_FLAGS, f"{where}: flags neither TRL nor this test knows: {extra}"
            gpus = _gpu_count(env, "CUDA_VISIBLE_DEVICES")
            assert gpus is None or gpus == served.tensor_parallel_size * served.data_parallel_size, f"{where}: TP x DP"
            assert served.host != "0.0.0.0", f"{where}: bind the dev-mode server to an address, not 0.0.0.0"
            gpus = env.get("CUDA_VISIBLE_DEVICES")
            servers.append({"model": served.model, "host": served.host, "port": served.port, "gpus": gpus})
        elif program in ("python", "python3") and args[0] == "-c":
            compile(args[1], where, "exec")
        elif program in ("python", "python3") and args[0] == "-m":
            assert args[1] == "dhpo_trl", where
            from dhpo_trl.demo.embedded import main

            _parse_with_main(main, args[2:], monkeypatch)
        elif program in ("python", "python3", "dhpo-train"):
            if program == "dhpo-train" or args[0] == "examples/train_dhpo.py":
                check_training(args if program == "dhpo-train" else args[1:], 1, env, servers, where)
            else:
                check_python_script(args[0], args[1:], monkeypatch, where)
        elif program == "torchrun":
            from torch.distributed.run import get_args_parser

            run = get_args_parser().parse_args(args)
            _parse_with_main(_load_main(run.training_script), run.training_script_args, monkeypatch)
        elif program == "dhpo-evaluate":
            from dhpo_trl.evaluation.cli import build_parser

            build_parser().parse_args(args)
        elif program == "dhpo-plot":
            from dhpo_trl.evaluation.plotting import main

            _parse_with_main(main, args, monkeypatch)
        elif program in ("bash", "sbatch"):
            index = next(i for i, arg in enumerate(args) if arg.endswith(".sh"))
            path, extra = args[index], args[index + 1 :]
            assert (ROOT / path).is_file(), f"{where}: no {path}"
            recipe = check_script(path, env, where)
            if recipe is not None:  # the script pairs the trainer with its own server
                options = " ".join(args[:index])
                nodes = int(re.search(r"--nodes[ =](\d+)", options).group(1)) if "--nodes" in options else 5
                processes = (nodes - 1) * 8 if program == "sbatch" else _gpu_count(env, "TRAIN_GPUS") or 4
                parse_args(["--config", recipe, *extra, *CPU], num_processes=processes)
            elif path == "scripts/train_cpu.sh":
                from dhpo_trl.demo.embedded import main

                _parse_with_main(main, extra, monkeypatch)
            elif path == "scripts/gpu_zero3_moe_smoke.sh":
                _parse_with_main(
                    _load_main("scripts/gpu_zero3_moe_smoke.py"), ["--output_dir", "x", *extra], monkeypatch
                )
            elif path == "scripts/gpu_check.sh":  # it hands its arguments to scripts/gpu_check.py
                _parse_with_main(_load_main("scripts/gpu_check.py"), extra, monkeypatch)
            elif path == "scripts/fetch_gpu_wheels.sh":
                assert extra == [], f"{where}: scripts/fetch_gpu_wheels.sh takes no arguments"
            elif path == "scripts/mutation.sh":  # its arguments are modules of dhpo_trl/, as the script checks
                for module in extra:
                    name = module.removeprefix("dhpo_trl/").removesuffix(".py")
                    assert (ROOT / "dhpo_trl" / f"{name}.py").is_file(), f"{where}: no module dhpo_trl/{name}.py"
            elif path in ("benchmarks/long_study.sh", "benchmarks/power_study.sh"):  # OUT_DIR, then a commit or --report
                assert len(extra) in (1, 2) and not extra[0].startswith("-"), f"{where}: {path} OUT_DIR [COMMIT|--report]"
            else:
                assert path == "scripts/test.sh", f"{where}: unknown script {path}"
        elif program == "pip":
            assert args[0] == "install", where
            extras = set(_pyproject_extras())
            for requirement in args[1:]:
                if requirement == "-e":
                    continue
                if requirement.startswith(".") and "[" in requirement:
                    wanted = set(requirement[requirement.index("[") + 1 : -1].split(","))
                    assert wanted <= extras, f"{where}: no extra {wanted - extras}"
                else:
                    assert requirement in (".", "torch==2.13.0"), f"{where}: pip install {requirement}"
        elif program in ("hf", "curl", "nvidia-smi"):
            assert program != "hf" or args[0] == "download", where
        else:
            raise AssertionError(f"{where}: no parser for {shlex.join(argv)}; add one to this test")


@pytest.mark.parametrize("where,block", BLOCKS, ids=[where for where, _ in BLOCKS])
def test_printed_command_parses(where, block, monkeypatch):
    monkeypatch.chdir(ROOT)  # the commands are written for the repository root
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    check(where, block, monkeypatch)


@pytest.mark.parametrize(
    "block,message",
    [
        # a server-mode recipe without a server beside it
        ("accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 8 examples/train_dhpo.py "
         "--config examples/recipes/dhpo_e_qwen3_1.7b_base.yaml", "needs a vLLM server"),
        # 7 training processes: the batch plan refuses it
        ("accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 7 examples/train_dhpo.py "
         "--config examples/recipes/dhpo_e_qwen3_1.7b_base.yaml --vllm_mode colocate", "per_device_train_batch_size"),
        # a server for another model, and the default 240 s wait
        ("trl vllm-serve --model Qwen/Qwen3-4B-Base --host 127.0.0.1 &\naccelerate launch --config_file "
         "accelerate_configs/zero3.yaml --num_processes 4 examples/train_dhpo.py --config "
         "examples/recipes/dhpo_e_qwen3_1.7b_base.yaml", "another model"),
        ("trl vllm-serve --model Qwen/Qwen3-1.7B-Base --host 127.0.0.1 &\naccelerate launch --config_file "
         "accelerate_configs/zero3.yaml --num_processes 4 examples/train_dhpo.py --config "
         "examples/recipes/dhpo_e_qwen3_1.7b_base.yaml --vllm_server_host 127.0.0.1", "240 s default"),
        ("trl vllm-serve --model Qwen/Qwen3-1.7B-Base --host 127.0.0.1 --tensor_parallel_sise 4", "flags neither TRL"),
        ("trl vllm-serve --model Qwen/Qwen3-1.7B-Base", "not 0.0.0.0"),
        ("CUDA_VISIBLE_DEVICES=0,1 trl vllm-serve --model Qwen/Qwen3-1.7B-Base --host 127.0.0.1 "
         "--tensor-parallel-size 4", "TP x DP"),
        ("VLLM_TP=2 bash examples/vllm_server/serve_and_train_single_node.sh", "does not read VLLM_TP"),
        ("frobnicate --now", "no parser"),
        # a compiled packed arm: the benchmark refuses it after the parse
        ("python benchmarks/bench_dynamic_batching.py --arms trl,packed --compile", "packed\\+compile"),
    ],
)  # fmt: skip
def test_the_check_rejects_what_it_should(block, message, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises((AssertionError, ValueError), match=message):
        check("example", block, monkeypatch)


@pytest.mark.parametrize(
    "block",
    [
        "python benchmarks/routing_replay.py --overhead-only --overhead-row 4",  # an abbreviation of --overhead-rows
        "    python benchmarks/routing_replay.py --overhead-cols 4",  # no such flag
    ],
)
def test_a_flag_the_parser_does_not_know_by_its_full_name_fails(block, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit):
        check("example", textwrap.dedent(block), monkeypatch)
    assert "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("block", "flag"),
    [
        ("python benchmarks/bench_speed.py --device cpu --repeats 4", "--repeats"),  # options_error
        ("python benchmarks/routing_replay.py --train --overhead-rows 4", "--overhead-rows"),  # unused_options
        ("python benchmarks/staleness.py --ks 2 4 --on-policy-objectives GRPO", "--on-policy-objectives"),  # inline
        ("python benchmarks/study.py --seeds 0 1 1", "--seeds"),  # inline, after the parse
    ],
)
def test_a_benchmarks_own_checks_of_its_options_run(block, flag, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    with pytest.raises((AssertionError, SystemExit)) as refused:
        check("example", block, monkeypatch)
    assert flag in str(refused.value) + capsys.readouterr().err


def test_an_indented_command_block_is_extracted():
    text = "- an item:\n\n      python benchmarks/routing_replay.py --repeats 2 \\\n          --json a.json\n\n  more"
    expected = "python benchmarks/routing_replay.py --repeats 2 \\\n    --json a.json\n"
    assert list(_blocks_from_markdown(text)) == [expected]
