"""The documentation site builds under ``mkdocs build --strict``, and its docstring rewriting works.

The doctests of the pages themselves run via ``pytest docs`` (``--doctest-glob=*.md``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import griffe
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


roles = _load("griffe_roles")


@pytest.fixture()
def toy_package(tmp_path: Path) -> Path:
    pkg = tmp_path / "toypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent('''
        """Toy package: see :class:`Widget` and :func:`~toypkg.tools.make`."""
        from .tools import Widget, make

        __all__ = ["Widget", "make"]
    '''))
    (pkg / "tools.py").write_text(textwrap.dedent('''
        """Tools."""


        class Widget:
            """A widget; :meth:`spin` spins it, :meth:`_secret` is private.

            Raises :class:`ValueError`; takes a :class:`torch.Generator`; see :func:`missing_thing`.

            Example:
                >>> 1 + 1
                2
            """

            def spin(self) -> None:
                """Spin."""

            def _secret(self) -> None:
                """Hidden."""


        def make() -> Widget:
            """Make a :class:`Widget`."""
            return Widget()
    '''))
    return tmp_path


def test_roles_become_links_code_or_checked_references(toy_package: Path):
    ext = griffe.load_extensions(roles.SphinxRoles)
    pkg = griffe.load("toypkg", search_paths=[str(toy_package)], extensions=ext)
    top = pkg.docstring.value
    assert "[`Widget`][toypkg.tools.Widget]" in top          # short name, resolved through the re-export
    assert "[`make`][toypkg.tools.make]" in top               # ~ shows the last component only
    doc = pkg["tools.Widget"].docstring.value
    assert "[`spin`][toypkg.tools.Widget.spin]" in doc        # resolved in the class scope
    assert "`_secret`" in doc and "][toypkg.tools.Widget._secret]" not in doc  # private: plain code
    assert "`ValueError`" in doc and "[`ValueError`]" not in doc              # builtin: plain code
    assert "`torch.Generator`" in doc and "[`torch.Generator`]" not in doc    # other package: plain code
    assert "[`missing_thing`][missing_thing]" in doc          # unresolvable: left for autorefs to report
    assert "Examples:" in doc and "Example:\n" not in doc     # the section griffe renders as code
    assert ":class:" not in doc and ":meth:" not in doc


def test_pending_pages_get_a_placeholder_only_while_missing():
    hooks = _load("mkdocs_hooks")
    assert "performance.md" in hooks.PENDING_PAGES
    assert "Coming with issue 3" in hooks.PENDING_PAGES["performance.md"]


#: Public modules whose API page is still a "coming with issue N" placeholder (docs/api/*.md).
#: Remove a module from here when its page gets its ``::: module`` directive.
PENDING_API: set[str] = set()


def _public_modules() -> list[str]:
    """``robustagg.x`` and ``robustagg.functional.y`` for every public module or package on disk."""
    out = []
    for base, prefix in ((ROOT / "robustagg", "robustagg"), (ROOT / "robustagg" / "functional", "robustagg.functional")):
        for p in sorted(base.iterdir()):
            name = p.stem if p.suffix == ".py" else p.name
            if name.startswith("_") or not (p.suffix == ".py" or (p / "__init__.py").exists()):
                continue
            out.append(f"{prefix}.{name}")
    return out


def test_every_public_module_has_an_api_page_or_a_pending_placeholder():
    directives = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs" / "api").glob("*.md"))
    documented = set(re.findall(r"^::: ([\w.]+)", directives, flags=re.MULTILINE))
    missing = [m for m in _public_modules() if m not in PENDING_API
               and not any(d == m or d.startswith(m + ".") for d in documented)]
    assert not missing, f"add a '::: module' directive to a page in docs/api/ (and to mkdocs.yml's nav) for {missing}"
    import robustagg as ra
    from robustagg import registry

    leaves = {d.rsplit(".", 1)[-1] for d in documented}
    undocumented = [n for n in ra.available() if registry.lookup(n).__module__.startswith("robustagg.")
                    and registry.lookup(n).__name__ not in leaves]
    assert not undocumented, f"add '::: robustagg.aggregators.<Class>' (or preaggregation) for {undocumented}"
    for m in PENDING_API:
        assert (ROOT / "robustagg" / m.split(".")[-1]).exists() or (ROOT / "robustagg" / (m.split(".")[-1] + ".py")).exists()


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path: Path):
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    aggregators = (site / "api" / "aggregators" / "index.html").read_text(encoding="utf-8")
    assert 'id="robustagg.aggregators.Krum"' in aggregators
    assert 'href="#robustagg.aggregators.Aggregator"' in aggregators  # a :class: role became a link
    assert ":class:" not in aggregators
    assert (site / "assumptions" / "index.html").exists()
    assert (site / "performance" / "index.html").exists()  # the real page, or the placeholder until it exists
