"""``inflight serve`` takes what vLLM users type for ``vllm serve``: its flags parsed by the
real parser, and their effects on a real server started with them."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_harness import CHAT_TEMPLATE, ServerProcess

from inflight.entrypoints import serve_cli
from inflight.entrypoints.cli import build_parser, main
from inflight.entrypoints.engine_args import engine_options, vllm_flags
from inflight.vllm_engine_args import VLLM_ONLY_ARGS

KEYS = ("sk-first", "sk-second")
ROOT_PATH = "/behind/proxy"


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def parse_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """argparse's message for a command line it refuses."""
    with pytest.raises(SystemExit) as exit_info:
        serve_args(*argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


# ---------------------------------------------------------------------- parsing


def test_enable_auto_tool_choice_is_accepted() -> None:
    args = serve_args("m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    assert not serve_args("m").enable_auto_tool_choice


def test_log_request_flags() -> None:
    assert serve_args("m").enable_log_requests is False  # off by default, as in vLLM
    assert serve_args("m", "--enable-log-requests").enable_log_requests is True
    assert serve_args("m", "--disable-log-requests").disable_log_requests is True
    assert serve_args("m", "--no-disable-log-requests").disable_log_requests is False


def test_model_as_positional_or_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_args("--model", "/models/a", "--port", "1").model == "/models/a"
    assert serve_args("/models/a").model == "/models/a"
    assert serve_args("/models/a", "--model", "/models/a").model == "/models/a"
    assert serve_args().model is None
    assert "two models given" in parse_error(capsys, "/models/a", "--model", "/models/b")
    assert "two models given" in parse_error(capsys, "--model", "/models/b", "/models/a")


def test_chunked_prefill_both_ways() -> None:
    assert serve_args("m").enable_chunked_prefill is True
    assert serve_args("m", "--enable-chunked-prefill").enable_chunked_prefill is True
    assert serve_args("m", "--no-enable-chunked-prefill").enable_chunked_prefill is False


@pytest.mark.parametrize("alias, dtype", [("half", "float16"), ("float", "float32")])
def test_dtype_aliases(alias: str, dtype: str) -> None:
    from inflight.config import ModelConfig

    options = engine_options(serve_args("m", "--dtype", alias))
    assert options["dtype"] == alias
    assert ModelConfig(model=None, dtype=options["dtype"], device="cuda").dtype == dtype


@pytest.mark.parametrize(
    "text, tokens",
    [("2048", 2048), ("4k", 4000), ("4K", 4096), ("1m", 10**6), ("1M", 2**20),
     ("2g", 2 * 10**9), ("2G", 2 * 2**30), ("25.6k", 25600), (" 8k ", 8000),
     ("-1", None), ("auto", None), ("AUTO", None)],
)
def test_human_readable_max_model_len(text: str, tokens: int | None) -> None:
    assert serve_args("m", "--max-model-len", text).max_model_len == tokens


@pytest.mark.parametrize("text", ["1.5K", "1a", "10.24", "pwd", "4 k", ""])
def test_bad_max_model_len(capsys: pytest.CaptureFixture[str], text: str) -> None:
    assert "--max-model-len" in parse_error(capsys, "m", "--max-model-len", text)


def test_human_readable_batch_and_cache_sizes() -> None:
    args = serve_args("m", "--max-num-batched-tokens", "8K", "--kv-cache-memory-bytes", "1G")
    assert (args.max_num_batched_tokens, args.kv_cache_memory_bytes) == (8192, 2**30)


def test_every_vllm_only_argument_is_a_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """The one table LLM() checks drives the flags: each of its arguments has its vLLM
    flag (data-parallel size is serve's own, with a meaning here)."""
    with pytest.raises(SystemExit):
        serve_args("--help")
    help_text = capsys.readouterr().out
    for name, rule in VLLM_ONLY_ARGS.items():
        assert all(flag in help_text for flag in vllm_flags(name, rule)), name
    assert serve_args("m", "-dp", "1").data_parallel_size == 1


@pytest.mark.parametrize(
    "argv, name, value",
    [(["-tp", "1"], "tensor_parallel_size", 1),
     (["--tensor-parallel-size", "1"], "tensor_parallel_size", 1),
     (["-pp", "1"], "pipeline_parallel_size", 1),
     (["--pipeline-parallel-size", "1"], "pipeline_parallel_size", 1),
     (["--trust-remote-code"], "trust_remote_code", True),
     (["--enforce-eager"], "enforce_eager", True),
     (["--no-enforce-eager"], "enforce_eager", False),
     (["--gpu-memory-utilization", "0.9"], "gpu_memory_utilization", 0.9),
     (["--swap-space", "4"], "swap_space", 4.0),
     (["--disable-log-stats"], "disable_log_stats", True),
     (["--cpu-offload-gb", "0"], "cpu_offload_gb", 0.0),
     (["--tokenizer", "None"], "tokenizer", None),
     (["--load-format", "auto"], "load_format", "auto"),
     (["--hf-overrides", "{}"], "hf_overrides", {}),
     (["-O0"], "compilation_config", 0),
     (["--distributed-executor-backend", "mp"], "distributed_executor_backend", "mp"),
     (["--no-enable-lora"], "enable_lora", False),
     (["--no-skip-tokenizer-init"], "skip_tokenizer_init", False),
     (["--speculative-config", "None"], "speculative_config", None),
     (["--async-scheduling"], "async_scheduling", True)],
)
def test_neutral_vllm_flags_are_accepted(argv: list[str], name: str, value: Any) -> None:
    options = engine_options(serve_args("m", *argv))
    assert options[name] == value and type(options[name]) is type(value)


def test_tokenizer_may_name_the_model_itself(tiny_llama_dir: Path) -> None:
    """As ``LLM(model=p, tokenizer=p)``: vLLM commands often pass the model again."""
    args = serve_args(str(tiny_llama_dir), "--tokenizer", str(tiny_llama_dir))
    assert engine_options(args)["tokenizer"] == str(tiny_llama_dir)


def test_vllm_flags_not_given_are_not_passed() -> None:
    assert not set(engine_options(serve_args("m"))) & set(VLLM_ONLY_ARGS)


@pytest.mark.parametrize(
    "argv, said",
    [(["-tp", "2"], "--tensor-parallel-size 2 is not supported: tensor parallelism"),
     (["--pipeline-parallel-size", "4"], "--pipeline-parallel-size 4 is not supported"),
     (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5 is not supported"),
     (["--enable-lora"], "--enable-lora is not supported: LoRA"),
     (["--skip-tokenizer-init"], "--skip-tokenizer-init is not supported"),
     (["--tokenizer", "other/tok"], "--tokenizer other/tok is not supported"),
     (["-O3"], "--compilation-config 3 is not supported")],
)
def test_other_values_are_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    assert main(["serve", "m", *argv]) == 2  # before any model loads
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err


def test_uvicorn_log_level_is_uvicorns_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from inflight.entrypoints.openai import api_server

    levels: list[str] = []

    def run_server(engine: Any, config: Any, **options: Any) -> int:
        levels.append(options["log_level"])
        return 0

    monkeypatch.setattr(api_server, "run_server", run_server)
    monkeypatch.setattr(serve_cli, "start_engine", lambda *args: None)
    assert main(["serve", "m", "--log-level", "warning", "--uvicorn-log-level", "trace"]) == 0
    assert main(["serve", "m", "--log-level", "warning"]) == 0
    assert levels == ["trace", "warning"]


def test_api_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFLIGHT_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert serve_cli.api_keys(serve_args("m", "--api-key", "k1", "k2")) == ("k1", "k2")
    assert serve_cli.api_keys(serve_args("m")) == ()
    monkeypatch.setenv("INFLIGHT_API_KEY", "from-env")
    assert serve_cli.api_keys(serve_args("m")) == ("from-env",)
    assert serve_cli.api_keys(serve_args("m", "--api-key", "k1")) == ("k1",)
    monkeypatch.delenv("INFLIGHT_API_KEY")
    monkeypatch.setenv("VLLM_API_KEY", "vllm-env")  # a vLLM user's protected server
    assert serve_cli.api_keys(serve_args("m")) == ("vllm-env",)


@pytest.mark.parametrize("port", ["-1", "65536", "99999"])
def test_port_out_of_range_is_one_line(capsys: pytest.CaptureFixture[str], port: str) -> None:
    with pytest.raises(SystemExit):
        serve_args("m", "--port", port)
    err = capsys.readouterr().err
    assert "a port is 0-65535" in err and "Traceback" not in err


def test_default_served_model_name_is_the_model_as_given() -> None:
    assert serve_cli.default_served_model_name("/models/foo") == "/models/foo"
    assert serve_cli.default_served_model_name("models/foo/") == "models/foo/"
    assert serve_cli.default_served_model_name("m.gguf") == "m.gguf"
    assert serve_cli.default_served_model_name(None) == "SmolLM2-135M-Instruct"


def test_chat_template_file_or_template(tmp_path: Path) -> None:
    """vLLM's rule: a file it can read is read (whatever its name holds); else a value
    with '{', '}' or a newline is the template, as written; else a missing path."""
    braced = tmp_path / "t{1}.jinja"
    braced.write_text("{{ messages[0]['content'] }}")
    assert serve_cli.load_chat_template(str(braced)) == "{{ messages[0]['content'] }}"
    assert serve_cli.load_chat_template("line one\nline two") == "line one\nline two"
    assert serve_cli.load_chat_template("x }}") == "x }}"
    # escapes are not decoded (vLLM returns an inline template as written)
    assert serve_cli.load_chat_template(r"{{ 'a' }}\n") == "{{ 'a' }}\\n"
    with pytest.raises(ValueError, match="looks like a file path"):
        serve_cli.load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="looks like a file path"):
        serve_cli.load_chat_template(str(tmp_path))  # a folder


# ---------------------------------------------------------------------- on a real server


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, start_server: Callable[..., ServerProcess]) -> ServerProcess:
    """One server started with vLLM's flags; no --served-model-name."""
    return start_server(
        "--model", str(tiny_llama_dir), "--api-key", *KEYS, "--response-role", "bot",
        "--root-path", ROOT_PATH + "/", "--enable-log-requests", "--disable-log-requests",
        "--chat-template", CHAT_TEMPLATE, "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes", "-tp", "1", "--enforce-eager", "--trust-remote-code",
        "--gpu-memory-utilization", "0.9", "--max-model-len", "0.25k", "--max-num-seqs", "4",
        "--uvicorn-log-level", "warning", "--dtype", "float",
    )


def client(server: ServerProcess, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def test_served_under_the_model_argument_as_given(
    server: ServerProcess, tiny_llama_dir: Path
) -> None:
    (card,) = client(server).models.list().data
    assert card.id == str(tiny_llama_dir)
    assert card.max_model_len == 250  # type: ignore[attr-defined]  # --max-model-len 0.25k


def test_any_of_the_api_keys(server: ServerProcess) -> None:
    for key in KEYS:
        assert len(client(server, key).models.list().data) == 1
    for key in ("sk-third", KEYS[0][:-1], KEYS[0] + KEYS[1]):
        with pytest.raises(openai.AuthenticationError):
            client(server, key).models.list()
    assert httpx.get(f"{server.url}/v1/models").status_code == 401


def test_fastapi_docs_pages(server: ServerProcess, tiny_llama_dir: Path) -> None:
    """vLLM serves Swagger UI and ReDoc, open like /openapi.json; --disable-fastapi-docs
    turns them off."""
    for page in ("/docs", "/redoc"):
        response = httpx.get(f"{server.url}{page}")
        assert response.status_code == 200 and "openapi.json" in response.text
    from inprocess_server import InProcessServer

    plain = InProcessServer(tiny_llama_dir, disable_fastapi_docs=True).start()
    try:
        assert httpx.get(f"{plain.url}/docs").status_code == 404
        assert httpx.get(f"{plain.url}/openapi.json").status_code == 200
    finally:
        plain.stop()
    assert serve_args("m", "--disable-fastapi-docs").disable_fastapi_docs is True


def test_root_path(server: ServerProcess) -> None:
    headers = {"Authorization": f"Bearer {KEYS[1]}"}
    prefixed = httpx.get(f"{server.url}{ROOT_PATH}/v1/models", headers=headers)
    assert prefixed.status_code == 200  # a proxy that keeps the prefix
    assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 200
    schema = httpx.get(f"{server.url}/openapi.json").json()
    assert {"url": ROOT_PATH} in schema["servers"]  # "--root-path /prefix/" is "/prefix"
    operation_ids = [op["operationId"] for path in schema["paths"].values()
                     for op in path.values()]
    assert len(operation_ids) == len(set(operation_ids))  # /ping's GET and POST differ


def test_response_role(server: ServerProcess, tiny_llama_dir: Path) -> None:
    chat = client(server).chat.completions
    messages: Any = [{"role": "user", "content": "w3 w4"}]
    options: dict[str, Any] = dict(model=str(tiny_llama_dir), messages=messages, max_tokens=3)
    assert chat.create(**options).choices[0].message.role == "bot"  # type: ignore[comparison-overlap]
    first = next(iter(chat.create(**options, stream=True)))
    assert first.choices[0].delta.role == "bot"  # type: ignore[comparison-overlap]
    # without a generation prompt the answer continues the last message's role
    own = chat.create(**options, extra_body={"add_generation_prompt": False})
    assert own.choices[0].message.role == "user"  # type: ignore[comparison-overlap]


def test_log_requests(server: ServerProcess, tiny_llama_dir: Path) -> None:
    client(server).completions.create(
        model=str(tiny_llama_dir), prompt=[5, 6, 7], max_tokens=2, temperature=0
    )
    lines = [line for line in server.log().splitlines() if "Received request cmpl-" in line]
    assert len(lines) == 1, server.log()
    assert "INFO" in lines[0] and "prompt tokens: 3" in lines[0] and "max_tokens=2" in lines[0]
    client(server).responses.create(model=str(tiny_llama_dir), input="w3", max_output_tokens=2)
    assert "Received request resp_" in server.log()
    log = server.log()
    assert "--disable-log-requests is deprecated" in log
    assert "tensor_parallel_size=1 accepted with no effect" in log
    assert "Uvicorn running on" not in log  # --uvicorn-log-level warning; ours stays at info
