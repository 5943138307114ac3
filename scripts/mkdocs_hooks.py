"""MkDocs hooks for the documentation build (``hooks:`` in ``mkdocs.yml``).

Some pages are written by other parts of the project (``docs/performance.md`` by the kernel
benchmark). Until such a page exists, the build generates a short placeholder in its place, in the
built site only (nothing is written to ``docs/``), so that the navigation and the links to it stay
valid under ``mkdocs build --strict``. As soon as the real file exists it is used instead.
"""

from __future__ import annotations

import logging

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.robustagg")

#: Pages another part of the project writes -> placeholder shown until it does.
PENDING_PAGES: dict[str, str] = {
    "performance.md": (
        "# Performance\n\n"
        '!!! note "Coming with issue 3"\n'
        "    This page is written by the kernel benchmark (`make bench`): measured time per call of\n"
        "    every rule against the memory-bandwidth floor, for d from 1e5 to 1e8 and n from 10 to 100.\n"
        "    It has not been generated in this checkout yet.\n"
    ),
}


def on_files(files: Files, *, config: MkDocsConfig) -> Files:
    for uri, text in PENDING_PAGES.items():
        if files.get_file_from_path(uri) is None:
            log.info("docs/%s does not exist yet: the site shows a placeholder page", uri)
            files.append(File.generated(config, uri, content=text))
    return files
