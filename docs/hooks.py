"""MkDocs hooks: the generated reference pages, and pages the nav does not name yet.

The reference comes from the code (``tuneloop.cli.reference``) at every build, so it cannot
drift from what the code accepts. A page added under ``docs/`` without an entry in
``mkdocs.yml``'s nav joins the section of its folder (``how-to/`` the how-to guides,
``tutorial/`` the tutorials, the rest Explanation) instead of vanishing from the menus.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

from tuneloop.cli import reference

SECTIONS = {"how-to": "How-to guides", "tutorial": "Tutorials", "": "Explanation"}


def _named(nav: Any) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*(_named(item) for item in nav)) if nav else set()
    if isinstance(nav, dict):
        return set().union(*(_named(value) for value in nav.values())) if nav else set()
    return set()


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    docs = Path(config.docs_dir)
    named = _named(config.nav)
    for page in sorted(docs.rglob("*.md")):
        uri = page.relative_to(docs).as_posix()
        folder = uri.split("/")[0] if "/" in uri else ""
        if uri in named or folder not in SECTIONS:
            continue
        for section in config.nav or []:
            if isinstance(section, dict) and SECTIONS[folder] in section:
                section[SECTIONS[folder]].append(uri)
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    root = Path(config.config_file_path).parent
    for uri, text in reference.pages(root).items():
        files.append(File.generated(config, uri, content=text))
    return files
