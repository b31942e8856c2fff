"""The registry's aliases and version tags, read without importing MLflow.

The ``init`` stage's no-op check (``champion``) and ``tuneloop status`` (``aliases``,
``version_tags``) read them here.

``dvc repro`` runs ``init`` every time (DVC cannot see an alias move). Asking MLflow would
cost the stage its import and its SQLite store (about 7 s of CPU on 2 cores) only to find,
almost always, that nothing moved. So the alias is read here: over the server's REST API
(``tuneloop.tracking.rest``), or from the project's SQLite store read-only with the standard
library. A store this cannot read (another database, a schema it does not know) raises
``CannotTell``, and the stage asks MLflow as before.
"""

from __future__ import annotations

import contextlib
import sqlite3
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tuneloop.tracking import init_from, rest, runs


class CannotTell(RuntimeError):
    """This store cannot be read without MLflow; ask MLflow."""


class NoStore(CannotTell):
    """The project's SQLite store does not exist yet: nothing is registered. (Asking MLflow
    would create it.)"""


def champion(name: str, alias: str = "champion") -> init_from.Champion | None:
    """The version of registered model ``name`` holding ``alias`` (None: no such alias)."""
    uri = runs.tracking_uri()
    if rest.is_server(uri):
        found = rest.Client(uri).alias_version(name, alias)
        if found is None:
            return None
        label = f"{name} v{found['version']}"
        batches = init_from.trained_batches(found["tags"], label)
        return init_from.Champion(found["version"], found["run_id"], batches)
    return _from_sqlite(_sqlite_path(uri), name, alias)


def aliases(name: str) -> dict[str, str]:
    """``{alias: version}`` of registered model ``name`` (empty: no such model, no alias)."""
    uri = runs.tracking_uri()
    if rest.is_server(uri):
        try:
            found = rest.Client(uri).call("GET", "registered-models/get", {"name": name})
        except rest.RestError as error:
            if error.code == "RESOURCE_DOES_NOT_EXIST":
                return {}
            raise
        listed = found.get("registered_model", {}).get("aliases", [])
        return {str(a["alias"]): str(a["version"]) for a in listed}
    path = _sqlite_path(uri)
    with _reading(path) as db:
        rows = db.execute(
            "SELECT alias, version, workspace FROM registered_model_aliases WHERE name = ?",
            (name,),
        ).fetchall()
    _one_workspace(rows, f"registered model {name!r}", path)
    return {str(alias): str(version) for alias, version, _ in rows}


def version_tags(name: str, version: str) -> dict[str, str]:
    """The tags of ``name`` v``version``."""
    uri = runs.tracking_uri()
    if rest.is_server(uri):
        found = rest.Client(uri).call(
            "GET", "model-versions/get", {"name": name, "version": version}
        )
        tags = found.get("model_version", {}).get("tags", [])
        return {str(t["key"]): str(t["value"]) for t in tags}
    path = _sqlite_path(uri)
    if not version.isdigit():
        raise ValueError(f"{name} v{version!r}: a model version is a number")
    with _reading(path) as db:
        rows = db.execute(
            "SELECT key, value, workspace FROM model_version_tags WHERE name = ? AND version = ?",
            (name, int(version)),
        ).fetchall()
    _one_workspace(rows, f"{name} v{version}", path)
    return {str(key): str(value) for key, value, _ in rows}


def _sqlite_path(uri: str) -> Path:
    """The file of a ``sqlite:///`` store (``sqlite:////abs`` -> ``/abs``); ``NoStore`` when it
    does not exist yet, ``CannotTell`` for any other kind of store."""
    if not uri.startswith("sqlite:///"):
        raise CannotTell(f"tracking store {uri!r} is read through MLflow")
    path = Path(urllib.parse.unquote(uri.removeprefix("sqlite:///")))
    if not path.is_file():
        raise NoStore(f"no MLflow store at {path} yet (nothing registered)")
    return path


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[sqlite3.Connection]:
    """``path`` opened read-only; a schema this MLflow version does not have: ``CannotTell``."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            yield db
    except sqlite3.Error as error:
        raise CannotTell(f"{path}: {error}") from error


def _one_workspace(rows: list[Any], what: str, path: Path) -> None:
    """Rows whose last column is MLflow's workspace: several of them cannot be told apart here."""
    if len({row[-1] for row in rows}) > 1:
        raise CannotTell(f"{what} is in several workspaces of {path}")


def _from_sqlite(path: Path, name: str, alias: str) -> init_from.Champion | None:
    with _reading(path) as db:
        rows = db.execute(
            "SELECT version, workspace FROM registered_model_aliases WHERE name = ? AND alias = ?",
            (name, alias),
        ).fetchall()
        if not rows:
            return None
        _one_workspace(rows, f"{name}@{alias}", path)
        version, workspace = rows[0]
        found = db.execute(
            "SELECT run_id FROM model_versions WHERE name = ? AND version = ? AND workspace = ?",
            (name, version, workspace),
        ).fetchone()
        tags = dict(
            db.execute(
                "SELECT key, value FROM model_version_tags WHERE name = ? AND version = ? "
                "AND workspace = ?",
                (name, version, workspace),
            ).fetchall()
        )
    if found is None:
        raise CannotTell(f"{name}@{alias} names version {version}, which is not in {path}")
    batches = init_from.trained_batches(tags, f"{name} v{version}")
    return init_from.Champion(str(version), found[0] or None, batches)
