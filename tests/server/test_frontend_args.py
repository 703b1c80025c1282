"""vLLM's HTTP front-end flags on ``inflight serve``: --config, CORS, X-Request-Id,
--middleware, --enable-force-include-usage, TLS, and the flags refused by name."""

from __future__ import annotations

import argparse
import json
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from fastapi.testclient import TestClient
from server_harness import ServerProcess, free_port

from inflight.entrypoints.config_file import with_config_file
from inflight.entrypoints.openai.frontend import (
    add_frontend_args,
    frontend_config,
    install_frontend,
)


def _config(*argv: str) -> object:
    parser = argparse.ArgumentParser()
    add_frontend_args(parser)
    return frontend_config(parser.parse_args(list(argv)))


def _serve(*argv: str) -> subprocess.CompletedProcess[str]:
    """``inflight serve`` with flags refused before the model loads (no model is given)."""
    return subprocess.run(
        [sys.executable, "-m", "inflight.entrypoints.cli", "serve", *argv],
        capture_output=True, text=True, timeout=120,
    )


# --config: where the file's options go


def test_config_file_options_go_after_the_subcommand_so_the_command_line_wins(
    tmp_path: Path,
) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(
        "port: 8001\nmax_model_len: 4096\nenable-prefix-caching: false\n"
        "enforce-eager: true\napi-key: [a, b]\nhf-overrides: {x: 1}\n"
    )
    has_no_form = {"--no-enable-prefix-caching"}.__contains__
    argv = with_config_file(["serve", "model", "--config", str(path), "--port", "9"], has_no_form)
    assert argv == [
        "serve", "model", "--port", "8001", "--max-model-len", "4096",
        "--no-enable-prefix-caching", "--enforce-eager", "--api-key", "a", "b",
        "--hf-overrides", '{"x": 1}', "--port", "9",
    ]
    # argparse keeps the last value: the command line's port
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int)
    assert parser.parse_known_args(argv[1:])[0].port == 9


def test_config_file_options_go_after_a_positional_model_whose_file_model_is_dropped(
    tmp_path: Path,
) -> None:
    # A list last in the file took the positional model as one more value (an API key), and
    # the file's model: beside a positional one was "two models given"; vLLM puts the file's
    # options after the model, and the command line's model wins.
    path = tmp_path / "serve.yaml"
    path.write_text("model: other\nmiddleware: [a.B, c.d]\napi-key: [k1, k2]\n")
    repeats = {"--middleware"}.__contains__
    argv = with_config_file(["serve", "mine", "--config", str(path)], lambda flag: False, repeats)
    assert argv == ["serve", "mine", "--middleware", "a.B", "--middleware", "c.d",
                    "--api-key", "k1", "k2"]
    assert with_config_file(["serve", "--config", str(path)], lambda flag: False)[:3] == [
        "serve", "--model", "other"]


def test_a_config_file_that_is_not_yaml_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "a.yaml"
    path.write_text("a: [\n")
    with pytest.raises(ValueError, match="not valid YAML") as error:
        with_config_file(["serve", "--config", str(path)], lambda flag: False)
    assert "\n" not in str(error.value) and "line 2" in str(error.value)


@pytest.mark.parametrize(
    ("name", "text", "argv", "message"),
    [
        ("a.json", "{}", None, "must be YAML"),
        ("a.yaml", "- 1\n- 2\n", None, "must be a mapping"),
        ("a.yaml", "port: [1\n", None, "not valid YAML"),
        ("missing.yaml", None, None, "No such file"),
        ("a.yaml", "port: 1\n", ["serve", "--config"], "needs a YAML file"),
        ("a.yaml", "port: 1\n", ["serve", "--config", "X", "--config", "X"], "given 2 times"),
    ],
)
def test_a_config_file_that_cannot_be_used_is_one_error(
    tmp_path: Path, name: str, text: str | None, argv: list[str] | None, message: str
) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    argv = [a.replace("X", str(path)) for a in argv or ["serve", "--config", "X"]]
    with pytest.raises(ValueError, match=message):
        with_config_file(argv, lambda flag: False)


# The middleware, on a bare app


def _app(*argv: str) -> TestClient:
    app = FastAPI()

    @app.get("/hello")
    async def hello() -> PlainTextResponse:
        return PlainTextResponse("hello " * 200)

    install_frontend(app, _config(*argv))  # type: ignore[arg-type]
    return TestClient(app)


def test_cors_answers_only_the_origins_allowed() -> None:
    preflight = {"Access-Control-Request-Method": "POST"}
    closed = _app()  # vLLM 0.32's default: no origin allowed
    assert closed.options("/hello", headers={"Origin": "http://a.example", **preflight}).status_code == 400
    client = _app("--allowed-origins", '["http://a.example"]')
    ok = client.options("/hello", headers={"Origin": "http://a.example", **preflight})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "http://a.example"
    other = client.options("/hello", headers={"Origin": "http://b.example", **preflight})
    assert other.status_code == 400
    simple = client.get("/hello", headers={"Origin": "http://a.example"})
    assert simple.headers["access-control-allow-origin"] == "http://a.example"


def test_request_id_headers_echo_the_clients_or_make_one() -> None:
    assert "x-request-id" not in _app().get("/hello").headers
    client = _app("--enable-request-id-headers")
    assert client.get("/hello", headers={"X-Request-Id": "abc-1"}).headers["x-request-id"] == "abc-1"
    made = {client.get("/hello").headers["x-request-id"] for _ in range(2)}
    assert len(made) == 2 and all(len(i) == 32 for i in made)


def test_middleware_by_import_path_is_added() -> None:
    client = _app("--middleware", "starlette.middleware.gzip.GZipMiddleware")
    response = client.get("/hello", headers={"Accept-Encoding": "gzip"})
    assert response.headers["content-encoding"] == "gzip"
    assert response.text.startswith("hello hello")  # the client undid the compression


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--middleware", "no_such_module.thing"], "cannot import it"),
        (["--middleware", "json.dumps"], "a class or a coroutine function"),
        (["--ssl-keyfile", "/no/such.key", "--ssl-certfile", "/no/such.crt"], "no such file"),
        (["--ssl-certfile", "/no/such.crt"], "needs both"),
        (["--ssl-ca-certs", "/x"], "need --ssl-keyfile"),
        (["--api-server-count", "2"], "--api-server-count 2 is not supported"),
        (["--lora-modules", "a=/x", "b=/y"], "--lora-modules a=/x b=/y is not supported: LoRA"),
        (["--tool-parser-plugin", "x.py"], "no plugins"),
        (["--sse-keep-alive-interval", "5"], "keep-alive"),
    ],
)
def test_a_frontend_flag_that_cannot_act_is_refused_by_name(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(*argv)


def test_a_middleware_module_that_fails_to_import_or_a_bad_certificate_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Were a traceback (exit 1) and, for the certificate, "[SSL] PEM lib" after the model loaded.
    (tmp_path / "broken_mw.py").write_text("def f(:\n")
    (tmp_path / "raising_mw.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="broken_mw.f: cannot import it: SyntaxError"):
        _config("--middleware", "broken_mw.f")
    with pytest.raises(ValueError, match="raising_mw.f: cannot import it: RuntimeError: boom"):
        _config("--middleware", "raising_mw.f")
    not_a_key = tmp_path / "x.pem"
    not_a_key.write_text("not a key\n")
    with pytest.raises(ValueError, match="cannot load the certificate and key"):
        _config("--ssl-keyfile", str(not_a_key), "--ssl-certfile", str(not_a_key))


def test_forced_usage_is_on_every_chunk_as_in_vllm() -> None:
    # vLLM 0.32's should_include_usage: --enable-force-include-usage is (True, True) whatever
    # stream_options says.
    from inflight.entrypoints.openai.protocol import CompletionRequest

    def request(**stream_options: bool) -> CompletionRequest:
        body = {"model": "m", "prompt": "p", "stream": True}
        return CompletionRequest.model_validate(
            {**body, "stream_options": stream_options} if stream_options else body)

    assert request().stream_usage(True) == (True, True)
    assert request().stream_usage(False) == (False, False)
    assert request(include_usage=False).stream_usage(True) == (True, True)
    assert request(continuous_usage_stats=True).stream_usage(False) == (False, False)
    both = request(include_usage=True, continuous_usage_stats=True)
    assert both.stream_usage(False) == (True, True)


def test_refusals_come_before_the_model_loads() -> None:
    done = _serve("/no/such/model", "--api-server-count", "3")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "inflight: error: --api-server-count 3 is not supported: one API server process "
        "serves here (scale out: --data-parallel-backend ray)"
    ]
    bad_json = _serve("--allowed-origins", "*")
    assert bad_json.returncode == 2 and "not a JSON list" in bad_json.stderr
    assert "Traceback" not in bad_json.stderr + done.stderr


# A real server: --config with a command-line override, forced usage


def test_served_from_a_config_file_with_forced_usage(
    tmp_path: Path, tiny_llama_dir: Path, start_server: Callable[..., ServerProcess]
) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"model: {tiny_llama_dir}\nserved-model-name: from-file\nmax-num-seqs: 4\n"
        "enable-request-id-headers: true\nenable_force_include_usage: true\nno-warmup: true\n"
    )
    server = start_server("--config", str(config), "--served-model-name", "from-cli")
    models = httpx.get(f"{server.url}/v1/models", timeout=30)
    assert [m["id"] for m in models.json()["data"]] == ["from-cli"]
    assert len(models.headers["x-request-id"]) == 32
    body = {"model": "from-cli", "prompt": "w3 w4", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as stream:
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    # vLLM 0.32: forced usage is on every chunk (continuous), the last one the total
    assert [c["usage"]["completion_tokens"] for c in chunks[-2:]] == [3, 3]
    assert chunks[-1]["choices"] == []


def _trusting(cert: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_https_with_a_certificate(tmp_path: Path, tiny_llama_dir: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "inflight.entrypoints.cli", "serve", str(tiny_llama_dir),
             "--port", str(port), "--no-warmup", "--ssl-keyfile", str(key),
             "--ssl-certfile", str(cert)],
            stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        deadline, answer = time.monotonic() + 180, None
        while answer is None and time.monotonic() < deadline and process.poll() is None:
            try:
                answer = httpx.get(f"https://127.0.0.1:{port}/v1/models", verify=_trusting(cert), timeout=2)
            except httpx.HTTPError:
                time.sleep(0.5)
        assert answer is not None and answer.status_code == 200, log.read_text()
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)
    finally:
        process.terminate()
        assert process.wait(timeout=60) == 0
