"""A served engine computes on one thread: it is built, warmed up and stepped on its
engine thread, never on the main thread (two threads with OpenMP pools on a machine with
few cores made every CPU kernel of the server's steps about 2x slower; see
``engine/engine_thread.py``)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from inflight.engine.async_engine import AsyncLLMEngine
from inflight.engine.engine_thread import EngineThread
from inflight.worker.model_runner import ModelRunner


def test_model_is_built_warmed_up_and_stepped_on_the_engine_thread(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastapi.testclient import TestClient

    from inflight.entrypoints.openai.api_server import build_app
    from inflight.entrypoints.openai.serving import ServerConfig

    built: list[int] = []
    stepped: list[int] = []
    real_init, real_execute = ModelRunner.__init__, ModelRunner.execute_model

    def init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        built.append(threading.get_ident())
        real_init(self, *args, **kwargs)

    def execute(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        stepped.append(threading.get_ident())
        return real_execute(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "__init__", init)
    monkeypatch.setattr(ModelRunner, "execute_model", execute)
    engine = AsyncLLMEngine.from_options(str(tiny_llama_dir))
    engine.warm_up()
    warm_up_steps = len(stepped)
    app = build_app(engine, ServerConfig(served_model_names=("tiny",)))
    with TestClient(app) as client:
        response = client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 3}
        )
        assert response.status_code == 200
    assert engine._thread is not None
    engine_thread = engine._thread.ident
    assert built == [engine_thread]
    assert warm_up_steps > 0 and len(stepped) > warm_up_steps
    assert set(stepped) == {engine_thread}
    assert engine_thread != threading.main_thread().ident


def test_engine_thread_runs_jobs_in_order_and_hands_back_results_and_errors() -> None:
    thread = EngineThread(name="test-engine-thread")
    order: list[str] = []
    assert thread.call(lambda: order.append("a") or threading.get_ident()) == thread.ident
    with pytest.raises(ZeroDivisionError):
        thread.call(lambda: 1 / 0)
    assert thread.call(lambda: order.append("b") or len(order)) == 2  # still alive after an error
    done = threading.Event()
    thread.run_last(done.set)
    thread.join(timeout=10)
    assert done.is_set() and not thread.is_alive()


def test_a_failed_build_raises_and_ends_its_thread(tmp_path: Path) -> None:
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(Exception, match="no-such-model"):
        AsyncLLMEngine.from_options(str(tmp_path / "no-such-model"))
    for thread in threading.enumerate():
        if thread.ident not in before and thread.name == "inflight-engine":
            thread.join(timeout=10)
            assert not thread.is_alive(), "the engine thread outlived a failed build"
