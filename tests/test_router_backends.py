"""Backend launch commands, ``wait_healthy``, and (slow) ``transformers serve`` via the router."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from tests.helpers import loopback_server
from tuneloop.net import free_port
from tuneloop.release.backends import (
    LoraModule,
    start_transformers_serve,
    transformers_serve_command,
    transformers_served_model,
    vllm_serve_command,
    wait_healthy,
)

# The whole suite (`make test`): transformers serve
pytestmark = pytest.mark.slow

logger = logging.getLogger(__name__)


def test_transformers_serve_command_pins_the_folder() -> None:
    command = transformers_serve_command(Path("models/merged"), 8001)
    assert command == [
        "transformers", "serve", "--host", "127.0.0.1", "--port", "8001",
        "--device", "cpu", "--dtype", "auto", "models/merged",
    ]  # fmt: skip
    assert transformers_served_model(Path("models/merged")) == "models/merged"


def test_vllm_command_plain_and_with_lora() -> None:
    plain = vllm_serve_command(Path("models/fp8"), 8000, "support-v8", python="/s/bin/python")
    assert plain == [
        "/s/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "models/fp8",
        "--host", "127.0.0.1", "--port", "8000", "--served-model-name", "support-v8",
    ]  # fmt: skip
    lora = vllm_serve_command(
        Path("models/fp8"),
        8000,
        "base",
        lora_modules=[LoraModule("support", Path("/a/support")), LoraModule("copy", Path("/a/c"))],
        max_lora_rank=64,
        python="/s/bin/python",
    )
    assert lora[len(plain) :] == [
        "--enable-lora", "--max-lora-rank", "64",
        "--lora-modules", "support=/a/support", "copy=/a/c",
    ]  # fmt: skip
    assert lora[: len(plain)] == [*plain[:-1], "base"]
    assert "--enable-lora" not in plain


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lora_modules": [LoraModule("a=b", Path("/x"))]}, "without '='"),
        ({"lora_modules": [LoraModule("a", Path("/x")), LoraModule("a", Path("/y"))]}, "twice"),
        ({"lora_modules": [LoraModule("base", Path("/x"))]}, "twice"),
        ({"max_lora_rank": 16}, "LoRA is not enabled"),
        ({"port": 0}, "port"),
    ],
)
def test_vllm_command_refuses_ambiguous_input(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"model_dir": Path("m"), "port": 8000, "served_model_name": "base"}
    with pytest.raises(ValueError, match=message):
        vllm_serve_command(**(args | kwargs))  # type: ignore[arg-type]


@contextmanager
def http_stub(routes: dict[str, list[int]]) -> Iterator[str]:
    """A loopback server answering each path with the next status in its list (the last repeats)."""
    calls: dict[str, int] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            statuses = routes.get(self.path, [404])
            n = calls.get(self.path, 0)
            calls[self.path] = n + 1
            self.send_response(statuses[min(n, len(statuses) - 1)])
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, format: str, *args: object) -> None:
            pass  # keep test output clean

    with loopback_server(Handler) as url:
        yield url


def test_wait_healthy_polls_until_ready() -> None:
    with http_stub({"/health": [503, 503, 200]}) as url:
        assert wait_healthy(url, timeout=5, interval=0.01) < 5


def test_wait_healthy_falls_back_to_models_without_health() -> None:
    with http_stub({"/v1/models": [200]}) as url:
        assert wait_healthy(url + "/", timeout=5, interval=0.01) < 5


def test_wait_healthy_times_out_naming_the_url() -> None:
    with http_stub({"/health": [503]}) as url, pytest.raises(TimeoutError, match=url):
        wait_healthy(url, timeout=0.2, interval=0.05)


def test_wait_healthy_stops_when_the_backend_exits() -> None:
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()
    with pytest.raises(RuntimeError, match="code 3"):
        wait_healthy("http://127.0.0.1:9", timeout=30, process=process)


def test_transformers_serve_behind_the_router(tmp_path: Path) -> None:
    """The CPU backend for real: the tiny model, launched by our command, behind the router."""
    from tests.router_helpers import make_config, running_router  # the loopback helpers
    from tuneloop.demo.domain import tokenizer_corpus
    from tuneloop.demo.tiny import save_tiny
    from tuneloop.params import TinyModel

    shape = TinyModel(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=600, max_position_embeddings=512,
    )  # fmt: skip
    model_dir = tmp_path / "tiny"
    save_tiny(model_dir, shape, tokenizer_corpus(0), seed=0)
    backend = start_transformers_serve(model_dir, free_port(), tmp_path / "serve.log", threads=1)
    try:
        url = backend.url
        waited = backend.wait_healthy(timeout=120)
        logger.info("transformers serve healthy after %.1f s", waited)
        # Its share of the cores: one torch thread, where two backends share a host.
        environ = Path(f"/proc/{backend.process.pid}/environ").read_bytes().split(b"\0")
        assert b"OMP_NUM_THREADS=1" in environ and b"HF_HUB_OFFLINE=1" in environ
        config = make_config({"champion": url, "challenger": url}, tmp_path / "feedback")
        config = config.model_copy(
            update={
                "arms": {
                    arm: a.model_copy(update={"model": transformers_served_model(model_dir)})
                    for arm, a in config.arms.items()
                }
            }
        )
        with running_router(config) as client:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            reply = client.post("/v1/chat/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["role"] == "assistant"
            with client.stream(
                "POST", "/v1/chat/completions", json={**body, "stream": True}, timeout=60
            ) as streamed:
                events = [line for line in streamed.iter_lines() if line.startswith("data:")]
            assert events and "choices" in json.loads(events[0][5:])
    finally:
        backend.stop(grace=20)
