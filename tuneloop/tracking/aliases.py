"""The registry's champion, read without importing MLflow: the ``init`` stage's no-op check.

``dvc repro`` runs ``init`` every time (DVC cannot see an alias move). Asking MLflow would
cost the stage its import and its SQLite store (about 7 s of CPU on 2 cores) only to find,
almost always, that nothing moved. So the alias is read here: over the server's REST API
(``tuneloop.tracking.rest``), or from the project's SQLite store read-only with the standard
library. A store this cannot read (another database, a schema it does not know) raises
``CannotTell``, and the stage asks MLflow as before.
"""

from __future__ import annotations

import sqlite3
import urllib.parse
from pathlib import Path

from tuneloop.tracking import init_from, rest, runs


class CannotTell(RuntimeError):
    """This store cannot be read without MLflow; ask MLflow."""


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
    if uri.startswith("sqlite:///"):
        return _from_sqlite(Path(urllib.parse.unquote(uri.removeprefix("sqlite:///"))), name, alias)
    raise CannotTell(f"tracking store {uri!r} is read through MLflow")


def _from_sqlite(path: Path, name: str, alias: str) -> init_from.Champion | None:
    # sqlite:////abs/path -> "/abs/path"; sqlite:///rel/path -> "rel/path".
    if not path.is_file():
        raise CannotTell(f"{path} does not exist yet")
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            rows = db.execute(
                "SELECT version, workspace FROM registered_model_aliases "
                "WHERE name = ? AND alias = ?",
                (name, alias),
            ).fetchall()
            if not rows:
                return None
            if len(rows) > 1:
                raise CannotTell(f"{name}@{alias} is in several workspaces")
            version, workspace = rows[0]
            found = db.execute(
                "SELECT run_id FROM model_versions WHERE name = ? AND version = ? "
                "AND workspace = ?",
                (name, version, workspace),
            ).fetchone()
            tags = dict(
                db.execute(
                    "SELECT key, value FROM model_version_tags WHERE name = ? AND version = ? "
                    "AND workspace = ?",
                    (name, version, workspace),
                ).fetchall()
            )
    except sqlite3.Error as error:  # a schema this MLflow version does not have
        raise CannotTell(f"{path}: {error}") from error
    if found is None:
        raise CannotTell(f"{name}@{alias} names version {version}, which is not in {path}")
    batches = init_from.trained_batches(tags, f"{name} v{version}")
    return init_from.Champion(str(version), found[0] or None, batches)
