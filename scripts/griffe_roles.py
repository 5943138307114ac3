"""Griffe extension for the docs build: Sphinx roles in docstrings become checked links.

The library's docstrings use reStructuredText roles (``:class:`Aggregator```,
``:func:`~robustagg.preaggregation.build_pipeline```) so that they read well in ``help()``. MkDocs
renders Markdown, where those roles would show up as raw text. This extension, loaded by
mkdocstrings (``extensions:`` in ``mkdocs.yml``), rewrites each role once the whole package is
loaded:

- a role whose target resolves to a public object of the package becomes a Markdown
  cross-reference ``[`Name`][canonical.path]``; mkdocs-autorefs then checks that the target is
  rendered somewhere in the site, so ``mkdocs build --strict`` fails on a broken reference;
- a role naming a private member (``_aggregate``), an undocumented attribute (not rendered), a
  Python builtin (``ValueError``) or another package (``torch.Generator``) becomes a plain code span;
- a role that resolves to nothing in the package stays a cross-reference to the text as written, so
  autorefs reports it, and the strict build fails, when (and only when) that docstring is rendered.

It also renames a docstring section titled ``Example:`` to ``Examples:``, the title griffe's Google
parser reads as runnable examples (rendered as a highlighted console session).

Resolution order for a short name: the scope of the documented object (griffe's ``resolve``), then a
unique public object anywhere in the package whose path ends with that name (``Reduction.reduce``). A ``~`` prefix shows only the last
component, as in Sphinx.
"""

from __future__ import annotations

import builtins
import re
from typing import Any, Iterator

import griffe

#: Griffe's Google parser reads only "Examples:" as a section of runnable examples; the singular
#: "Example:" would become an admonition whose ``>>>`` lines Markdown renders as nested quotes.
EXAMPLE = re.compile(r"^([ \t]*)Example:[ \t]*$", re.MULTILINE)

ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|exc|data|obj|const):`(~?)([^`<>]+)`")


def _walk(obj: griffe.Object) -> Iterator[griffe.Object]:
    yield obj
    for member in obj.members.values():
        if member.is_alias:
            continue
        yield from _walk(member)  # type: ignore[arg-type]


def _is_private(path: str) -> bool:
    leaf = path.rsplit(".", 1)[-1]
    return leaf.startswith("_") and not leaf.startswith("__")


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles in the docstrings of a package into autorefs cross-references."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        objects = list(_walk(pkg))
        by_name: dict[str, set[str]] = {}  # last path component -> public paths that end with it
        for obj in objects:
            if not _is_private(obj.path):
                by_name.setdefault(obj.name, set()).add(obj.path)
        for obj in objects:
            if obj.docstring is not None and ":" in obj.docstring.value:
                text = EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
                obj.docstring.value = ROLE.sub(lambda m, o=obj: self._replace(m, o, pkg, by_name), text)

    def _replace(self, match: re.Match[str], obj: griffe.Object, pkg: griffe.Module,
                 by_name: dict[str, set[str]]) -> str:
        tilde, target = match.group(1), match.group(2).strip()
        shown = target.rsplit(".", 1)[-1] if tilde else target
        if _is_private(target):
            return f"`{shown}`"
        path = self._resolve(target, obj, pkg, by_name)
        if path is None:
            if ("." not in target and hasattr(builtins, target)) or (
                    "." in target and target.split(".", 1)[0] != pkg.name):
                return f"`{shown}`"  # a builtin or another package (torch.Generator): plain code
            # Unresolvable inside the package: keep it as a link, so that autorefs reports it if (and
            # only if) this docstring is rendered on a page.
            return f"[`{shown}`][{target}]"
        # A private *module* on the path (robustagg._tensor.as_matrix) is fine: its page renders it.
        found = pkg.modules_collection[path]
        if not found.is_module and not found.docstring:
            return f"`{shown}`"  # undocumented members are not rendered (show_if_no_docstring: false)
        return f"[`{shown}`][{path}]"

    @staticmethod
    def _resolve(target: str, obj: griffe.Object, pkg: griffe.Module, by_name: dict[str, set[str]]) -> str | None:
        # A dotted path inside the package: follow aliases to the canonical object.
        if target.split(".", 1)[0] == pkg.name:
            try:
                found = pkg.modules_collection[target]
                return str(found.final_target.path if found.is_alias else found.path)
            except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
                return None
        # A short name: the object's own scope first, then a unique public name in the package.
        try:
            path = obj.resolve(target)
            found = pkg.modules_collection[path]
            return str(found.final_target.path if found.is_alias else found.path)
        except (griffe.NameResolutionError, KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            pass
        candidates = {p for p in by_name.get(target.rsplit(".", 1)[-1], set())
                      if p == target or p.endswith("." + target)}  # "Reduction.reduce" matches whole parts
        return next(iter(candidates)) if len(candidates) == 1 else None
