"""The eval runs through vLLM: the evaluate stage's scoring of a tiny model through a vLLM
server from ``.venv-serve`` (one start for the module, 2-4 minutes on 2 CPU cores) gives the
hf backend's answers and scores. Skips itself where ``make serve-setup`` has not built it.

The model is the tiny shape vLLM's CPU attention takes (head_dim 32), pre-trained a little so
the general suite's answers are numbers, not noise; float32 in both engines. Greedy decoding
of the same prompt tokens then agrees token for token (the log-probs differ by about 5e-7,
tests/test_vllm_serving.py), so every item's answer and metric values must be equal, not
just the suites' figures within an interval.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tuneloop.judge import scoring
from tuneloop.params import Params, TinyModel, load_params
from tuneloop.release import vllm_engine

SERVE_VENV = ROOT / ".venv-serve"
# head_dim 32: the smallest vLLM's CPU attention takes (16 fails at the first request).
SHAPE = TinyModel(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, intermediate_size=128, vocab_size=600, max_position_embeddings=512,
)  # fmt: skip
SUITE, GENERAL = "support_demo", "general_demo"
PRETRAIN_STEPS = 60

# The whole suite (`make test`): a vLLM server of its own where .venv-serve is built, lm_eval
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def params() -> Params:
    shipped = load_params(ROOT / "params.yaml")
    return shipped.model_copy(
        update={
            "evaluate": shipped.evaluate.model_copy(
                update={"suites": (SUITE,), "limit": 24, "general_limit": 24, "batch_size": 8}
            ),
            "paths": shipped.paths.model_copy(update={"eval_suites": ROOT / "eval"}),
            "serve": shipped.serve.model_copy(update={"venv": SERVE_VENV, "cpu_threads": 2}),
        }
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tuneloop.demo import domain, general, tiny

    corpus = itertools.chain(domain.tokenizer_corpus(0), general.corpus())
    tokenizer = tiny.build_tokenizer(corpus, SHAPE.vocab_size)
    built = tiny.build_model(SHAPE, tokenizer, seed=0)
    chats = list(general.train_chats(0, PRETRAIN_STEPS * tiny.PRETRAIN_BATCH))
    tiny.pretrain(built, tokenizer, chats, PRETRAIN_STEPS, seed=0)
    folder = tmp_path_factory.mktemp("eval-vllm") / "merged"
    built.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def both(params: Params, model: Path) -> tuple[scoring.Scored, scoring.Scored, Path]:
    if vllm_engine.find_engine(SERVE_VENV) is None:
        pytest.skip(f"{SERVE_VENV} holds no vLLM: `make serve-setup` builds it")
    tasks = scoring.task_index(params.paths.eval_suites, [SUITE, GENERAL])
    log_file = model.parent / "vllm-merged.log"
    served = scoring.score(model, params, tasks, "vllm", general=[GENERAL], log_file=log_file)
    hf = scoring.score(model, params, tasks, "hf", general=[GENERAL])
    return hf, served, log_file


def test_vllm_scores_every_item_as_the_hf_backend(
    both: tuple[scoring.Scored, scoring.Scored, Path],
) -> None:
    hf, served, _ = both
    assert set(served.items) == set(hf.items) == {SUITE, GENERAL}
    for suite, found in hf.items.items():
        other = served.items[suite]
        assert other.ids == found.ids and len(found.ids) == 24
        assert served.answers[suite] == hf.answers[suite]
        assert any(answer.strip() for answer in hf.answers[suite])  # not empty agreement
        for metric, values in found.values.items():
            assert other.values[metric].tolist() == values.tolist(), (suite, metric)
            assert other.weights[metric].tolist() == found.weights[metric].tolist()
    assert served.scores == hf.scores
    # Not an empty agreement: the pre-trained model answers some sums right.
    assert hf.scores[GENERAL]["accuracy"] > 0


def test_the_engine_is_named_and_its_server_gone(
    both: tuple[scoring.Scored, scoring.Scored, Path],
) -> None:
    hf, served, log_file = both
    engine = vllm_engine.find_engine(SERVE_VENV)
    assert engine is not None
    assert served.engine == f"{engine.version} (OpenAI server)"
    assert hf.engine == scoring.hf_engine()
    # Its log kept, with the requests lm-eval sent it.
    text = log_file.read_text(errors="replace")
    assert "Application startup complete" in text or "Started server process" in text
    assert "POST /v1/completions" in text
