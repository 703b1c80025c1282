"""Every command in the READMEs' ```bash blocks works as written (or is checked as far as
it can be here).

* ``inflight`` commands parse with the real argument parser, then run: ``generate`` on the
  tiny model (``--max-tokens 8`` appended); ``bench throughput`` with ``--dry-run`` (the
  plan and the files it would write), and for real, on the tiny model with
  ``--num-prompts 2``, when a later command reads its files (every file of the plan must
  then exist); ``bench workload`` and ``plot`` as written; ``bench serve`` with
  ``--dry-run`` (no server here); ``serve`` parsed only (tests/server runs the server).
* A file a command reads must ship with the repository or be written by an earlier
  command of the same README; placeholders (``PEERS_DIR``, ``OUT_DIR``, ``/tmp/...``)
  map to a temporary folder.
* Scripts (``./scripts/*``, ``bench/peers/*``) must exist; the peer engines' own commands
  (their venvs, cmake, pip) cannot run here and are only checked for the project scripts
  they call.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from inflight.bench import throughput
from inflight.bench.workloads import NAMED_WORKLOADS
from inflight.entrypoints.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
# Benchmark scripts run as modules: checked to exist (each takes minutes on the real model).
BENCH_MODULES = {
    "inflight.bench.block_matmul", "inflight.bench.structured_cost", "inflight.bench.dp_scaling",
    "inflight.bench.rate_plot", "inflight.bench.decode_attention", "inflight.bench.amx_linear",
}
INFLIGHT = {".venv/bin/inflight", "INFLIGHT_DIR/.venv/bin/inflight"}
# The tiny model has no chat template: this one joins the messages' contents.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
PEER_TOOLS = {"python3", "cmake", "pip", "tar", "ln", "nice", "flock", "cd"}


@dataclass
class Command:
    source: str  # README path and line, for messages
    tokens: list[str]

    def __str__(self) -> str:
        return f"{self.source}: {shlex.join(self.tokens)}"


def bash_commands(readme: Path) -> list[Command]:
    """Each command of the ```bash blocks: continuations joined, comments and '&' dropped."""
    commands, in_block, pending, start = [], False, "", 0
    for number, line in enumerate(readme.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            in_block = line.strip() == "```bash" and not in_block
            continue
        if not in_block:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        tokens = shlex.split(pending + line, comments=True)
        pending = ""
        if tokens and tokens[-1] == "&":
            tokens.pop()
        if tokens:
            commands.append(Command(f"{readme.relative_to(ROOT)}:{start}", tokens))
    return commands


def optional_variants(tokens: list[str]) -> list[list[str]]:
    """``[--flag value]`` in a README line: the command without it, and with it."""
    for i, token in enumerate(tokens):
        if token.startswith("["):
            end = next(j for j in range(i, len(tokens)) if tokens[j].endswith("]"))
            inner = [t.strip("[]") for t in tokens[i : end + 1]]
            rest = tokens[end + 1 :]
            return [
                [*tokens[:i], *variant, *tail]
                for variant in ([], inner)
                for tail in optional_variants(rest)
            ]
    return [tokens]


@dataclass
class Workspace:
    """Where the commands run: placeholders mapped to folders, files written so far."""

    tmp: Path
    tiny_model: str
    created: set[Path] = field(default_factory=set)
    read_later: set[Path] = field(default_factory=set)  # files some command reads

    def path(self, text: str, cwd: Path) -> Path:
        if text.startswith("/tmp/"):
            text = str(self.tmp / "slash-tmp" / text[len("/tmp/") :])
        for placeholder in ("PEERS_DIR", "OUT_DIR", "INFLIGHT_DIR"):
            text = text.replace(placeholder, str(self.tmp / placeholder.lower()))
        return (cwd / text).resolve()

    def require(self, path: Path, command: Command) -> None:
        assert path in self.created or path.is_file(), (
            f"{command} reads {path}, which no earlier README command writes"
        )


def run_inflight(command: Command, args: list[str], ws: Workspace, cwd: Path) -> None:
    parser = build_parser()
    for variant in optional_variants(args):
        parsed = parser.parse_args(variant)  # SystemExit (a failed test) if it does not parse
        args = [str(ws.path(a, cwd)) if _is_placeholder(a) else a for a in variant]
        name = parsed.command if parsed.command != "bench" else f"bench {parsed.bench_command}"
        os.chdir(cwd)
        if name == "serve":
            continue  # a server: tests/server starts and checks it
        if name == "generate":
            # A trace is read by `calibrate --from-trace` later, which needs >= 10 steps.
            max_tokens = "16" if parsed.trace else "8"
            assert main([*args, "--model", ws.tiny_model, "--max-tokens", max_tokens]) == 0
            if parsed.trace:
                ws.created.add(ws.path(parsed.trace, cwd))
                assert ws.path(parsed.trace, cwd).is_file()
        elif name == "bench throughput":
            run_bench_throughput(command, args, parsed, ws, cwd)
        elif name == "bench serve":
            if parsed.workload and parsed.workload not in NAMED_WORKLOADS:
                ws.require(ws.path(parsed.workload, cwd), command)
            assert main([*args, "--dry-run"]) == 0, command
        elif name == "bench workload":
            assert main(args) == 0, command
            written = ws.path(parsed.output, cwd)
            assert json.loads(written.read_text().splitlines()[0])["prompt_token_ids"]
            ws.created.add(written)
        elif name == "plot":
            for trace in parsed.traces:
                ws.require(ws.path(trace, cwd), command)
            assert main(args) == 0, command
            out_dir = ws.path(parsed.out_dir, cwd)
            assert all((out_dir / n).is_file() for n in ("timeline.png", "latency.png"))
        elif name == "calibrate":
            run_calibrate(command, args, parsed, ws, cwd)
        elif name == "simulate":
            if parsed.validate:
                continue  # replays the workload on the real model for minutes: parsed only
            assert main([*args, "--no-plots", "--output-dir", str(ws.tmp / "simulate")]) == 0
        else:
            pytest.fail(f"no check for {command}")


def run_calibrate(
    command: Command, args: list[str], parsed: Any, ws: Workspace, cwd: Path
) -> None:
    """From a trace as written (the trace must come from an earlier command); a sweep on
    the tiny model with a handful of steps."""
    output = ["--output", str(ws.tmp / "calibration.json")]
    if parsed.from_trace:
        ws.require(ws.path(parsed.from_trace, cwd), command)
        assert main([*args, *output]) == 0, command
        return
    small = ["--model", ws.tiny_model, "--dtype", "float32", "--batch-sizes", "1,2",
             "--context-lens", "8,16", "--prefill-lens", "16", "--decode-steps", "3"]
    assert main([*args, *small, *output]) == 0, command


def run_bench_throughput(
    command: Command, args: list[str], parsed: object, ws: Workspace, cwd: Path
) -> None:
    """A dry run; and a real one on the tiny model, 2 requests, into the folder the full
    command would use, when a later command reads its files."""
    assert main([*args, "--dry-run"]) == 0, command
    workload = throughput.load_workload(parsed)  # type: ignore[arg-type]
    results = throughput.output_path(parsed, workload.name)  # type: ignore[arg-type]
    files = [(cwd / f).resolve() for f in throughput.planned_files(parsed, results)]  # type: ignore[arg-type]
    if not ws.read_later & set(files):
        ws.created.update(files)
        return
    reduced = ["--model", ws.tiny_model, "--num-prompts", "2", "--no-isolate", "--no-warmup"]
    reduced += ["--no-bench-lock", "--output-json", str(results)]
    assert main([*args, *reduced]) == 0, command
    missing = [f for f in files if not f.is_file()]
    assert not missing, f"{command} did not write {missing}"
    ws.created.update(files)


def _is_placeholder(arg: str) -> bool:
    return any(p in arg for p in ("PEERS_DIR", "OUT_DIR", "INFLIGHT_DIR")) or arg.startswith(
        "/tmp/"
    )


def check_script(command: Command, tokens: list[str], ws: Workspace, cwd: Path) -> None:
    """A project script (or a peer command calling one): the scripts it names exist."""
    for token in (t.strip("[]") for t in tokens):
        if re.match(r"(\./)?(scripts|bench/peers)/", token):
            script = ROOT / token.removeprefix("./")
            assert script.is_file(), f"{command}: {token} does not exist"
            if script.suffix in ("", ".sh"):
                assert os.access(script, os.X_OK), f"{command}: {token} is not executable"
        if re.match(r"PEERS_DIR/workload_\w+\.jsonl$", token):
            ws.require(ws.path(token, cwd), command)


def check_readme(readme: Path, ws: Workspace, peers: bool) -> None:
    commands = bash_commands(readme)
    for command in commands:  # the traces `plot` reads: the runs that write them must run
        if command.tokens[0] in INFLIGHT and command.tokens[1] == "plot":
            ws.read_later.update(ws.path(t, ws.tmp) for t in command.tokens[2:] if ".jsonl" in t)
    cwd = previous = ws.tmp
    for command in commands:
        tokens = command.tokens
        while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
            tokens = tokens[1:]  # environment assignments
        program = tokens[0]
        if program == "cd":
            cwd, previous = (previous, cwd) if tokens[1] == "-" else (ws.path(tokens[1], cwd), cwd)
            cwd.mkdir(parents=True, exist_ok=True)
        elif program in INFLIGHT:
            run_inflight(command, tokens[1:], ws, cwd)
        elif program == ".venv/bin/python" and tokens[1] == "-m" and tokens[2] in BENCH_MODULES:
            assert importlib.util.find_spec(tokens[2]) is not None, command
        elif re.match(r"(\./)?(scripts|bench/peers)/", program):
            check_script(command, tokens, ws, cwd)
        elif peers and (program in PEER_TOOLS or "/" in program):
            check_script(command, tokens, ws, cwd)  # needs the peers' venvs: scripts only
        else:
            pytest.fail(f"no check for {command}")


@pytest.fixture
def workspace(tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Workspace:
    """The tiny model with 2048 positions (seed8's 128 + 500 tokens fit) and a chat template."""
    tiny = tmp_path / "tiny-2048"
    shutil.copytree(tiny_llama_dir, tiny)
    for name, extra in (
        ("config.json", {"max_position_embeddings": 2048}),
        ("tokenizer_config.json", {"chat_template": CHAT_TEMPLATE}),
    ):
        config = json.loads((tiny / name).read_text())
        (tiny / name).write_text(json.dumps(config | extra))
    monkeypatch.chdir(tmp_path)  # the commands' relative outputs land here
    monkeypatch.setenv("BENCH_LOCK", str(tmp_path / "bench.lock"))
    work = tmp_path / "work"
    work.mkdir()
    return Workspace(work, str(tiny))


def test_readme_commands_run(workspace: Workspace) -> None:
    check_readme(ROOT / "README.md", workspace, peers=False)
    assert workspace.created  # the checks above really ran commands


def test_speed_log_commands_run(workspace: Workspace) -> None:
    """The measurement log (moved out of the README) keeps its commands working too."""
    check_readme(ROOT / "docs" / "speed-log.md", workspace, peers=False)
    assert workspace.created


def test_peers_readme_commands(workspace: Workspace) -> None:
    check_readme(ROOT / "bench" / "peers" / "README.md", workspace, peers=True)
    peers = workspace.tmp / "peers_dir"
    assert {p.name for p in peers.iterdir()} >= {"workload_mixed.jsonl", "workload_seed8.jsonl"}
