"""The server takes the model's generation config as its defaults, as vLLM's does: a
field the request leaves out comes from the config, and its ``max_new_tokens`` caps
``max_tokens`` (vLLM's ``get_max_tokens``). Expected: the same request with the values
written out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from inprocess_server import InProcessServer

from helpers.tiny_model import with_generation_config


def test_the_server_uses_the_model_s_defaults(tiny_llama_dir: Path, tmp_path: Path) -> None:
    configured_dir = with_generation_config(
        tiny_llama_dir, tmp_path / "tiny", max_new_tokens=4, temperature=0.0,
        repetition_penalty=1.3, top_k=5,
    )
    server = InProcessServer(configured_dir).start()
    try:
        def complete(**fields: Any) -> dict[str, Any]:
            body = {"model": "tiny", "prompt": [5, 6, 7, 8], **fields}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return dict(response.json())

        silent = complete()
        explicit = complete(max_tokens=4, temperature=0, repetition_penalty=1.3)
        assert silent["choices"][0]["text"] == explicit["choices"][0]["text"]
        assert silent["usage"]["completion_tokens"] == 4
        # max_new_tokens caps even a request's own max_tokens (vLLM's get_max_tokens)
        assert complete(max_tokens=10, temperature=0)["usage"]["completion_tokens"] == 4
        # Beam search: the config's sampling defaults are not the client's choices (no 400
        # for top_k), and its max_new_tokens caps the beams too.
        beams = complete(max_tokens=30, n=2, use_beam_search=True, ignore_eos=True)
        assert [len(c["text"].split()) for c in beams["choices"]] == [4, 4]
        chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "w3 w4"}],
            "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] <= 4
    finally:
        server.stop()


def test_serve_flags_reach_the_engine(capsys: Any) -> None:
    import pytest

    from inflight.entrypoints.cli import build_parser
    from inflight.entrypoints.engine_args import engine_options

    args = build_parser().parse_args(
        ["serve", "m", "--generation-config", "vllm",
         "--override-generation-config", '{"temperature": 0.5}']
    )
    options = engine_options(args)
    assert options["generation_config"] == "vllm"
    assert options["override_generation_config"] == {"temperature": 0.5}
    assert engine_options(build_parser().parse_args(["serve", "m"]))["generation_config"] == "auto"
    for bad in ("{not json", "[1]"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "m", "--override-generation-config", bad])
        assert "--override-generation-config" in capsys.readouterr().err
