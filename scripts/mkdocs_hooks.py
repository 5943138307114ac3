"""MkDocs hooks for the documentation build (``hooks:`` in ``mkdocs.yml``).

Some pages are written by other parts of the project (``docs/performance.md`` by the kernel
benchmark). Until such a page exists, the build generates a short placeholder in its place, in the
built site only (nothing is written to ``docs/``), so that the navigation and the links to it stay
valid under ``mkdocs build --strict``. As soon as the real file exists it is used instead.

Every page's HTML is then finished here, offline:

- **math** (``$...$`` inline, ``$$...$$`` as a block: ``pymdownx.arithmatex`` in generic mode)
  is converted to MathML at build time (:func:`render_math`, the ``latex2mathml`` package), which
  browsers draw natively: no script and no font is fetched, at build or at view time;
- every **figure** (an ``<img>`` not already inside a link) becomes a link to the image itself
  (:func:`link_figures`), so a wide figure squeezed to the text column opens full size.

``docs/stylesheets/extra.css`` makes wide tables scroll sideways instead of being cut off, and
keeps names in table cells whole.
"""

from __future__ import annotations

import html as _html
import logging
import re

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


_MATH = re.compile(r'<(span|div) class="arithmatex">\\([(\[])(.*?)\\([)\]])</\1>', re.S)
_IMG = re.compile(r"<img\b[^>]*>")
_SRC = re.compile(r'\bsrc="([^"]+)"')


def render_math(html: str) -> str:
    """Replace every ``pymdownx.arithmatex`` (generic mode) span or div in ``html`` by MathML:
    ``<span class="arithmatex">\\(tex\\)</span>`` by inline ``<math>``, the ``div`` with
    ``\\[tex\\]`` by ``<math display="block">``.

    Raises:
        ValueError: TeX that ``latex2mathml`` cannot convert (the page and the formula are named
            by the caller's build error).
    """
    from latex2mathml.converter import convert

    def one(m: re.Match[str]) -> str:
        tex = _html.unescape(m.group(3))
        try:
            return convert(tex, display="block" if m.group(1) == "div" else "inline")
        except Exception as exc:  # noqa: BLE001 - re-raised with the formula
            raise ValueError(f"cannot render the formula {tex!r} as MathML: {exc}") from exc

    return _MATH.sub(one, html)


def link_figures(html: str) -> str:
    """Wrap every ``<img>`` of ``html`` that is not already inside a link in
    ``<a class="figure-full" href="<its src>" target="_blank">``: a click opens it full size."""
    out: list[str] = []
    pos = 0
    for m in _IMG.finditer(html):
        before = html[:m.start()]
        inside_link = before.rfind("<a ") > before.rfind("</a>")
        src = _SRC.search(m.group(0))
        out.append(html[pos:m.start()])
        if inside_link or src is None:
            out.append(m.group(0))
        else:
            out.append(f'<a class="figure-full" href="{src.group(1)}" target="_blank">{m.group(0)}</a>')
        pos = m.end()
    out.append(html[pos:])
    return "".join(out)


def on_page_content(html: str, **kwargs: object) -> str:
    """MkDocs hook: MathML for the page's formulas, full-size links for its figures."""
    return link_figures(render_math(html))


def on_files(files: Files, *, config: MkDocsConfig) -> Files:
    for uri, text in PENDING_PAGES.items():
        if files.get_file_from_path(uri) is None:
            log.info("docs/%s does not exist yet: the site shows a placeholder page", uri)
            files.append(File.generated(config, uri, content=text))
    return files
