"""The manual's reference pages, generated from the code so they cannot drift from it.

Five pages: every ``params.yaml`` key from the typed params models (type, default, the value
``params.yaml`` ships, description), every ``tuneloop`` command and flag from the argparse
parsers (the passthrough commands' own parsers included), every DVC stage from ``dvc.yaml``
with its stage module's docstring, the MLflow tags, metrics and artifacts each stage writes,
and every metrics file's fields from the models the stages write them through.
``docs/hooks.py`` adds them to the site at build time; ``missing_descriptions`` lists what has
no text yet, metrics-file fields included (tests/test_docs.py keeps it empty).

It lives under the CLI because it reads the CLI's parsers, and nothing below the CLI may.
"""

from __future__ import annotations

import argparse
import ast
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

PAGES = (
    "reference/params.md",
    "reference/cli.md",
    "reference/stages.md",
    "reference/mlflow.md",
    "reference/metrics.md",
)


@dataclass(frozen=True)
class Key:
    """One params key: its dotted path, type, default and description."""

    path: str
    type: str
    default: str
    description: str
    group: bool


@dataclass(frozen=True)
class Flag:
    """One command-line flag or positional argument of one command."""

    command: str
    names: str
    default: str
    help: str


# ---------------------------------------------------------------- params


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(f"`{a!r}`".replace("'", '"') for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "group"
    if annotation is type(None):
        return "null"
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{name}[{inner}]" if inner else name
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (directly, optionally, or as a dict's values), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _nested_model(arg)
        if found is not None:
            return found
    return None


def _default(field: Any) -> str:
    if field.default is not PydanticUndefined:
        return f"`{_yaml_text(field.default)}`"
    if field.default_factory is not None:
        return "`{}`" if "dict" in repr(field.default_factory) else "(computed)"
    return "required"


def _yaml_text(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, Path):
        value = str(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix(" ...").strip()


def param_keys(model: type[BaseModel], prefix: str = "") -> Iterator[Key]:
    """Every key under ``model``, depth first; a dict of models shows as ``<name>``."""
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        nested = _nested_model(field.annotation)
        is_map = typing.get_origin(field.annotation) in (dict, Mapping) or (
            typing.get_origin(field.annotation) is typing.Union
            and any(typing.get_origin(a) is dict for a in typing.get_args(field.annotation))
        )
        description = field.description or (nested.__doc__ or "" if nested else "")
        yield Key(
            path=path,
            type=_type_name(field.annotation),
            default=_default(field),
            description=" ".join(description.split()),
            group=nested is not None,
        )
        if nested is not None:
            yield from param_keys(nested, f"{path}.<name>." if is_map else f"{path}.")


def _shipped(values: Mapping[str, Any], path: str) -> str:
    node: Any = values
    for part in path.split("."):
        if part == "<name>" or not isinstance(node, Mapping) or part not in node:
            return ""
        node = node[part]
    if isinstance(node, Mapping) and node:
        return "(below)"
    return f"`{_yaml_text(node)}`"


def params_page(root: Path) -> str:
    from tuneloop.params import Params

    shipped = yaml.safe_load((root / "params.yaml").read_text(encoding="utf-8"))
    lines = [
        "# params.yaml",
        "",
        "Every key `params.yaml` accepts, generated from the typed params models in",
        "`tuneloop/params/` when this site is built. An unknown key is an error, and so is a",
        "wrong value: it fails before any stage does work, naming the key. *required* means",
        "the key has no default in the code: the value lies in `params.yaml` (its column).",
        "`<name>` stands for a name you choose (a task, a pool, a queue).",
    ]
    for key in param_keys(Params):
        if "." not in key.path:
            lines += ["", f"## `{key.path}`", "", key.description or "", ""]
            lines += ["| key | type | default | params.yaml | description |", "|" + "---|" * 5]
            continue
        cells = [
            f"`{key.path}`",
            key.type,
            key.default,
            _shipped(shipped, key.path),
            key.description,
        ]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- CLI


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[str, argparse.ArgumentParser]]:
    found: dict[str, tuple[str, argparse.ArgumentParser]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                found[name] = (helps.get(name, ""), sub)
    return found


def commands() -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """Every leaf command: its full name, one-line help and parser."""
    from tuneloop.cli import PASSTHROUGH, PASSTHROUGH_PARSERS, build_parser

    def walk(
        name: str, text: str, parser: argparse.ArgumentParser
    ) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
        subs = _subcommands(parser)
        if not subs:
            yield name, text, parser
        for sub, (sub_text, sub_parser) in subs.items():
            yield from walk(f"{name} {sub}".strip(), sub_text, sub_parser)

    yield from walk("", "", build_parser())
    for name, (_, text) in PASSTHROUGH.items():
        yield name, text, PASSTHROUGH_PARSERS[name]()


def flags(command: str, parser: argparse.ArgumentParser) -> Iterator[Flag]:
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        if action.help == argparse.SUPPRESS:
            continue
        names = ", ".join(action.option_strings) or (action.metavar or action.dest)
        default = action.default
        shown = "" if default in (None, False, argparse.SUPPRESS) else f"`{default}`"
        text = (action.help or "").replace("%(default)s", str(default))
        yield Flag(command, str(names), shown, " ".join(text.split()))


def cli_page() -> str:
    lines = [
        "# The tuneloop command",
        "",
        "Every command and flag, generated from the argparse parsers in `tuneloop/cli/` when",
        "this site is built. `tuneloop COMMAND --help` prints the same.",
    ]
    for name, text, parser in commands():
        lines += ["", f"## `tuneloop {name}`", ""]
        described = " ".join((parser.description or text).split())
        lines += [described, "", "```text", parser.format_usage().strip(), "```", ""]
        rows = list(flags(name, parser))
        if rows:
            lines += ["| flag | default | what it does |", "|---|---|---|"]
            for flag in rows:
                cells = [f"`{flag.names}`", flag.default, flag.help]
                lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- stages


def _stage_doc(root: Path, module: str) -> str:
    path = root / (module.replace(".", "/") + ".py")
    if not path.is_file():
        return ""
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def _paths(entries: list[Any]) -> list[str]:
    return [next(iter(e)) if isinstance(e, dict) else str(e) for e in entries or []]


def stages_page(root: Path) -> str:
    stages = yaml.safe_load((root / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    lines = [
        "# DVC stages",
        "",
        "Every stage of `dvc.yaml`, in its order, with its stage module's docstring; generated",
        "when this site is built. `base`, `task_names`, `ingest` and `champions` run once;",
        "every other stage once per task of `tasks:` (`foreach`; DVC names it",
        "`<stage>@<task>`), with `--task <name>`, the task's folder and its records. Code deps",
        "are the local modules the stage imports: a change to one reruns it.",
    ]
    for name, stage in stages.items():
        body = stage.get("do", stage)
        cmd = str(body.get("cmd", ""))
        module = cmd.split("-m ", 1)[1].split()[0] if "-m " in cmd else ""
        deps = _paths(body.get("deps", []))
        code = [d for d in deps if d.endswith(".py")]
        data = [d for d in deps if not d.endswith(".py")]
        lines += ["", f"## `{name}`", ""]
        if "foreach" in stage:
            lines += [f"Once per task (`foreach: {stage['foreach']}`).", ""]
        lines += ["```text", _stage_doc(root, module) or "(no docstring)", "```", ""]
        lines += [f"- **command**: `{cmd.strip()}`"]
        for label, items in (
            ("params", [str(p) for p in body.get("params", [])]),
            ("data deps", data),
            ("outs", _paths(body.get("outs", []))),
            ("metrics", _paths(body.get("metrics", []))),
            ("code deps", code),
        ):
            if items:
                lines.append(f"- **{label}**: " + ", ".join(f"`{i}`" for i in items))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- MLflow

# MLflow's writing calls (fluent, client and tuneloop's own wrappers), by what they write.
WRITES = {
    "set_tag": "tag",
    "set_tags": "tag",
    "log_metric": "metric",
    "log_metrics": "metric",
    "log_param": "param",
    "log_params": "param",
    "log_artifact": "artifact",
    "log_artifacts": "artifact",
    "log_dict": "artifact",
    "log_text": "artifact",
    "log_figure": "artifact",
    "log_inputs": "dataset",
}
# Where the key is among a call's arguments (after MlflowClient's run id): an artifact's
# folder or file name comes last.
KEY_AT = {"artifact": -1, "dataset": -1}


@dataclass(frozen=True)
class Write:
    """One call that writes to an MLflow run: what kind, its key, and where it is."""

    kind: str
    key: str
    where: str


def _constants(path: Path) -> dict[str, str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                    found[target.id] = node.value.value
    return found


def _module_aliases(tree: ast.Module, root: Path) -> dict[str, Path]:
    """``from tuneloop.tracking import runs`` -> {"runs": tuneloop/tracking/runs.py}."""
    aliases: dict[str, Path] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                path = root / (node.module.replace(".", "/") + f"/{alias.name}.py")
                if path.is_file():
                    aliases[alias.asname or alias.name] = path
    return aliases


def _key_text(node: ast.expr, local: dict[str, str], aliases: dict[str, Path]) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(
            str(part.value) if isinstance(part, ast.Constant) else f"<{ast.unparse(part.value)}>"  # type: ignore[attr-defined]
            for part in node.values
        )
    if isinstance(node, ast.Name) and node.id in local:
        return local[node.id]
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in aliases
    ):
        value = _constants(aliases[node.value.id]).get(node.attr)
        if value is not None:
            return value
    return f"<{ast.unparse(node)}>"


def _keys(call: ast.Call, kind: str, local: dict[str, str], aliases: dict[str, Path]) -> list[str]:
    args = list(call.args)
    if args and ast.unparse(args[0]).endswith("run_id"):  # MlflowClient: (run_id, key, ...)
        args = args[1:]
    args += [k.value for k in call.keywords if k.arg in ("artifact_path", "artifact_file")]
    if not args:
        return []
    node = args[KEY_AT[kind]] if kind in KEY_AT else args[0]
    if isinstance(node, ast.Dict):
        return [_key_text(k, local, aliases) for k in node.keys if k is not None]
    if isinstance(node, ast.DictComp):
        return [_key_text(node.key, local, aliases)]
    return [_key_text(node, local, aliases)]


def mlflow_writes(root: Path) -> list[Write]:
    """Every call in the library, stages and flows that writes to an MLflow run."""
    writes: list[Write] = []
    for folder in ("tuneloop", "stages", "flows"):
        for path in sorted((root / folder).rglob("*.py")):
            if path.is_relative_to(root / "tuneloop" / "cli"):
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            local, aliases = _constants(path), _module_aliases(tree, root)
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                    continue
                kind = WRITES.get(node.func.attr)
                receiver = ast.unparse(node.func.value)
                if kind is None or receiver in ("self", "cls"):
                    continue
                where = f"{path.relative_to(root).as_posix()}:{node.lineno}"
                writes += [Write(kind, key, where) for key in _keys(node, kind, local, aliases)]
    return writes


def mlflow_page(root: Path) -> str:
    lines = [
        "# MLflow: tags, metrics, params and artifacts",
        "",
        "Every call in `tuneloop/`, `stages/` and `flows/` that writes to an MLflow run, with the",
        "key as the code writes it, found in the source when this site is built. `<...>` is",
        "a part the code computes at run time: a stage's metrics come from its",
        "`metrics/<stage>.json` (`<metrics>`), the lineage tags from `lineage_tags` (git commit,",
        "`dvc.dep.<path>` and `dvc.out.<path>` md5s, `params.hash`, the flow run).",
    ]
    titles = {
        "tag": "Tags",
        "metric": "Metrics",
        "param": "Params",
        "artifact": "Artifacts",
        "dataset": "Dataset inputs",
    }
    writes = mlflow_writes(root)
    for kind, title in titles.items():
        rows = sorted({(w.key, w.where) for w in writes if w.kind == kind})
        lines += ["", f"## {title}", "", "| key | written at |", "|---|---|"]
        lines += [f"| `{key}` | `{where}` |" for key, where in rows]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- metrics files


def metrics_models() -> dict[str, tuple[type[BaseModel], ...]]:
    """Each stage's metrics file (``metrics/<key>.json``: a stage's, or each task's champion
    under ``champions/``) and the models its writer and its readers go through (merge's is one
    of two); evaluate.json is ``Scores``, not a model."""
    from tuneloop.data.metrics import CleanMetrics, IngestMetrics, PackMetrics, TaskNames
    from tuneloop.judge.decision import Decision
    from tuneloop.judge.fixed_badcases import FixedBadcasesMetrics
    from tuneloop.models import BaseMetrics
    from tuneloop.preflight.run import PreflightMetrics
    from tuneloop.quantization import ExportMetrics
    from tuneloop.tracking.init_from import InitMetrics, TaskChampion
    from tuneloop.training.merge import CopiedThrough, MergeMetrics
    from tuneloop.training.metrics import TrainMetrics

    return {
        "base": (BaseMetrics,),
        "init": (InitMetrics,),
        "task_names": (TaskNames,),
        "ingest": (IngestMetrics,),
        "champions/<task>": (TaskChampion,),
        "fixed_badcases": (FixedBadcasesMetrics,),
        "clean": (CleanMetrics,),
        "pack": (PackMetrics,),
        "preflight": (PreflightMetrics,),
        "train": (TrainMetrics,),
        "merge": (MergeMetrics, CopiedThrough),
        "export": (ExportMetrics,),
        "decision": (Decision,),
    }


def _doc(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split("\n\n")[0].split())


def metrics_page() -> str:
    lines = [
        "# Metrics files",
        "",
        "What each stage leaves in `metrics/<stage>.json` (`tasks/<task>/metrics/` for a",
        "task's stages): DVC's metrics (`dvc metrics show`, `dvc metrics diff`), the numbers on",
        "the stage's MLflow run, and what later stages, the flows and the model card read.",
        "Generated from the models the stages write them through and every reader reads them",
        "through, when this site is built: a file with a key missing or misspelt is refused,",
        "naming the file. `metrics/evaluate.json` is the scores, model -> suite -> metric ->",
        "value; `metrics/decision.json` is the gate's decision, written by evaluate.",
    ]
    for stage, models in metrics_models().items():
        lines += ["", f"## `metrics/{stage}.json`"]
        for model in models:
            intro = f"As `{model.__name__}`: {_doc(model)}" if len(models) > 1 else _doc(model)
            lines += ["", intro, "", "| key | type | description |", "|---|---|---|"]
            for key in param_keys(model):
                cells = [f"`{key.path}`", key.type, key.description]
                lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- checks


def missing_descriptions() -> list[str]:
    """Every params key, CLI command or flag and metrics-file field with no description, by
    name."""
    from tuneloop.params import Params

    missing = [f"params: {k.path}" for k in param_keys(Params) if not k.description]
    for name, text, parser in commands():
        if not (parser.description or text):
            missing.append(f"cli: tuneloop {name}")
        missing += [f"cli: tuneloop {name} {f.names}" for f in flags(name, parser) if not f.help]
    missing += [
        f"metrics: {stage}: {key.path}"
        for stage, models in metrics_models().items()
        for model in models
        for key in param_keys(model)
        if not key.description
    ]
    return missing


def pages(root: Path) -> dict[str, str]:
    """Each reference page's path under docs/ and its Markdown."""
    texts = (params_page(root), cli_page(), stages_page(root), mlflow_page(root), metrics_page())
    return dict(zip(PAGES, texts, strict=True))
