"""One router, several tasks on one base: each task's split, release and rollback are its own.

The backends stand in for one vLLM server holding every task's adapters: all four arms
point at the same server and differ by the adapter (model) name it is asked for.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from serving.config import RouterConfigError
from serving.routing import bucket
from serving.tasks import TasksConfig, create_tasks_app, load_config, tasks_config
from tests.router_helpers import (  # noqa: F401 (fixtures)
    PRODUCER,
    PRODUCERS,
    admin_token,
    backends,
    gate,
    router_secrets,
    serve,
)
from tuneloop.release.admin import AdminError, RouterAdmin

# The whole suite (`make test`): a router of two tasks on uvicorn, the CLI against it
pytestmark = pytest.mark.slow

ADAPTERS = {
    "support": {"champion": ("support-v1", "1"), "challenger": ("support-v2", "2")},
    "copy": {"champion": ("copy-v1", "1"), "challenger": ("copy-v2", "2")},
}
USERS = [f"user-{i}" for i in range(600)]


def settings(url: str, folder: Path, **task_extra: Any) -> dict[str, Any]:
    return {
        "feedback_dir": str(folder / "incoming"),
        "state_file": str(folder / "state" / "router.json"),
        "feedback_producers": PRODUCERS,
        "tasks": {
            task: {
                "arms": {
                    arm: {"base_url": url, "model": model, "model_version": version}
                    for arm, (model, version) in arms.items()
                },
                **task_extra.get(task, {}),
            }
            for task, arms in ADAPTERS.items()
        },
    }


@contextmanager
def running(config: TasksConfig) -> Iterator[httpx.Client]:
    with serve(create_tasks_app(config)) as url, httpx.Client(base_url=url, timeout=10) as client:
        yield client


def served(client: httpx.Client, task: str) -> dict[str, str]:
    """Each user's adapter for ``task``, as the backend saw it asked for."""
    found = {}
    for user in USERS:
        reply = client.post(
            "/v1/chat/completions",
            json={"model": task, "user": user, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert reply.status_code == 200, reply.text
        found[user] = reply.json()["model"]
    return found


def expected(task: str, percent: int) -> dict[str, str]:
    """The split the weight promises: users in buckets [0, percent) get the challenger."""
    arms = ADAPTERS[task]
    return {u: arms["challenger" if bucket(u) < percent else "champion"][0] for u in USERS}


def test_two_releases_at_once_each_keep_their_own_weight_and_rollback(
    backends: dict[str, str], tmp_path: Path, admin_token: dict[str, str]
) -> None:
    config = tasks_config(settings(backends["champion"], tmp_path))
    token = admin_token["Authorization"].split()[1]
    with running(config) as client:
        base = str(client.base_url)
        support = RouterAdmin([f"{base}/tasks/support"], token)
        copy = RouterAdmin([f"{base}/tasks/copy"], token)
        # Two releases at once, each holding its own task's lease.
        support.take_lease("release-support", 60)
        copy.take_lease("release-copy", 60)
        support.set_weight(10, "canary")
        copy.set_weight(50, "ramp")
        assert served(client, "support") == expected("support", 10)
        assert served(client, "copy") == expected("copy", 50)
        # A second release of one task is refused; the other task's lease does not matter.
        with pytest.raises(AdminError, match="held by release-support"):
            RouterAdmin([f"{base}/tasks/support"], token).take_lease("another", 60)

        took = support.rollback("canary failed its analysis")
        assert took < 1.0
        assert served(client, "support") == expected("support", 0)
        assert served(client, "copy") == expected("copy", 50)
        every = client.get("/admin/status", headers=admin_token).json()["tasks"]
        assert every["support"]["challenger_percent"] == 0
        assert every["support"]["lease"] is None
        assert every["copy"]["challenger_percent"] == 50
        assert every["copy"]["lease"]["holder"] == "release-copy"
        assert client.get("/admin/status").status_code == 401
        for admin in (support, copy):
            admin.close()

    # Each task's weight and lease are in a state file of its own, so a restart keeps both.
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [
        "copy.router.json",
        "support.router.json",
    ]
    with running(tasks_config(settings(backends["champion"], tmp_path))) as client:
        assert served(client, "support") == expected("support", 0)
        assert served(client, "copy") == expected("copy", 50)


def test_the_model_names_the_task(backends: dict[str, str], tmp_path: Path) -> None:
    config = tasks_config(
        settings(backends["champion"], tmp_path, copy={"public_model": "product-copy"})
    )
    with running(config) as client:
        listed = client.get("/v1/models").json()["data"]
        assert {(m["id"], m["task"]) for m in listed} == {
            ("support", "support"),
            ("product-copy", "copy"),
        }
        legacy = client.post("/v1/completions", json={"model": "product-copy", "prompt": "hi"})
        assert legacy.json()["model"] == "copy-v1"
        for body in ({"model": "copy"}, {"model": "gpt-4"}, {}, {"model": ["support"]}):
            wrong = client.post("/v1/chat/completions", json={**body, "messages": []})
            assert wrong.status_code == 404, body
            assert wrong.json()["error"]["code"] == "model_not_found"
            assert "['product-copy', 'support']" in wrong.json()["error"]["message"]
        too_big = client.post("/v1/chat/completions", content=b"{" + b" " * 5_000_000 + b"}")
        assert too_big.status_code == 413
        # A task's own endpoints answer at its prefix, and check the model there too.
        own = client.post(
            "/tasks/copy/v1/chat/completions", json={"model": "support", "messages": []}
        )
        assert own.status_code == 404


def test_feedback_lands_in_the_tasks_own_folder_and_never_counts_across_tasks(
    backends: dict[str, str], tmp_path: Path, admin_token: dict[str, str]
) -> None:
    config = tasks_config(settings(backends["champion"], tmp_path))
    flag = {
        "messages": [{"role": "user", "content": "Write the kettle's listing."}],
        "bad_response": "No.",
        "corrected_response": "Aurora kettle: 1.7 l, steel.",
    }
    with running(config) as client:
        reply = client.post(
            "/v1/chat/completions",
            json={"model": "copy", "user": "alice", "messages": flag["messages"]},
        )
        request_id = reply.headers["x-request-id"]
        # Flagged at the other task (whose versions are the same numbers): refused, and
        # nothing written where support's ingest would make it support's training data.
        elsewhere = client.post(
            "/tasks/support/v1/feedback", json={**flag, "request_id": request_id}, headers=PRODUCER
        )
        assert elsewhere.status_code == 409, elsewhere.text
        assert elsewhere.json()["kind"] == "wrong_task"
        assert "issued for task 'copy'" in elsewhere.json()["detail"]
        assert "/tasks/copy/v1/feedback" in elsewhere.json()["detail"]
        assert not list((tmp_path / "incoming").rglob("*.jsonl"))
        # Without a request id, or with one no task of this router signed: the endpoint's
        # task's unattributed badcase, as before.
        for request_id_given in (None, request_id[:-4] + "AAAA"):
            unattributed = client.post(
                "/tasks/support/v1/feedback",
                json={**flag, "request_id": request_id_given},
                headers=PRODUCER,
            )
            assert unattributed.status_code == 201 and unattributed.json()["attributed"] is False
        own = client.post(
            "/tasks/copy/v1/feedback", json={**flag, "request_id": request_id}, headers=PRODUCER
        )
        assert own.json()["attributed"] is True and own.json()["arm"] == "champion"
        top = client.post("/v1/feedback", json=flag, headers=PRODUCER)
        assert top.status_code == 404 and "/tasks/<task>/v1/feedback" in top.json()["detail"]
        stats = client.get("/tasks/copy/admin/stats", headers=admin_token).json()
        assert stats["arms"]["champion"]["badcases"] == 1
        stats = client.get("/tasks/support/admin/stats", headers=admin_token).json()
        assert stats["arms"]["champion"]["badcases"] == 0
    assert len(list((tmp_path / "incoming" / "copy").glob("router-feedback-*.jsonl"))) == 1
    [support] = (tmp_path / "incoming" / "support").glob("router-feedback-*.jsonl")
    assert [json.loads(line)["arm"] for line in support.read_text().splitlines()] == [None, None]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tasks": {}}, "tasks must map"),
        ({"tasks": {"Support Desk": {}}}, "task name 'Support Desk'"),
        ({"arms": {}}, "move them under tasks.<task>.arms"),
        ({"task_extra": {"copy": {"timeouts": {"read": 5}}}}, "tasks.copy sets ['timeouts']"),
        ({"task_extra": {"copy": {"public_model": "support"}}}, "share public_model 'support'"),
        ({"task_extra": {"copy": {"challenger_percent": 101}}}, "tasks.copy: 1 invalid"),
        (
            {"task_extra": {"copy": {"feedback_dir": "/x"}, "support": {"feedback_dir": "/x"}}},
            "share feedback_dir",
        ),
    ],
)
def test_a_wrong_tasks_config_names_the_task_and_key(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    data = settings("http://127.0.0.1:1", tmp_path, **change.pop("task_extra", {}))
    data.update(change)
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(RouterConfigError, match=None) as raised:
        load_config(path)
    assert message in str(raised.value)
    assert str(path) in str(raised.value)


def test_status_shows_every_task_and_a_rollback_names_its_task(
    backends: dict[str, str],
    tmp_path: Path,
    admin_token: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`tuneloop status` and `tuneloop rollback --task` against a router of two tasks."""
    from tests.helpers import write_params
    from tuneloop.cli import main

    config = tasks_config(settings(backends["champion"], tmp_path))
    with running(config) as client:
        project = tmp_path / "project"
        project.mkdir()
        path = write_params(project)
        params = yaml.safe_load(path.read_text())
        params["release"]["routers"] = [str(client.base_url)]
        params["tasks"] = {
            "support": {"folder": "tasks/support", "registered_model": "tuneloop-support"},
            "copy": {"folder": "tasks/copy", "registered_model": "tuneloop-copy"},
        }
        path.write_text(yaml.safe_dump(params, sort_keys=False))
        monkeypatch.chdir(project)
        for task, percent in (("support", 10), ("copy", 50)):
            client.post(
                f"/tasks/{task}/admin/weights",
                json={"challenger_percent": percent},
                headers=admin_token,
            ).raise_for_status()

        assert main(["rollback", "--reason", "incident"]) == 1
        assert "give --task" in capsys.readouterr().err
        assert main(["rollback", "--task", "copy", "--reason", "incident", "--operator", "me"]) == 0
        assert "/tasks/copy" not in capsys.readouterr().err
        assert main(["status", "--json"]) == 0
        every = json.loads(capsys.readouterr().out)["tasks"]
        weights = {
            task: [r["weights"]["challenger"] for r in result["routers"].values()]
            for task, result in every.items()
        }
        assert weights == {"support": [10], "copy": [0]}
        assert list(every["copy"]["routers"]) == [f"{client.base_url}/tasks/copy"]
        assert main(["status"]) == 0
        shown = capsys.readouterr().out
        assert "task support (support)" in shown and "task copy (copy)" in shown
