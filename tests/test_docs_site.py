"""The documentation site as a reader sees it (issue 28, "The docs site"): formulas rendered as
math at build time (MathML: no script, no CDN at build or view time), wide tables that scroll
instead of being cut off, and figures that open full size."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _hooks():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def test_math_becomes_mathml_at_build_time() -> None:
    hooks = _hooks()
    html = ('<p>if <span class="arithmatex">\\(\\|F(X) - \\bar x_S\\|^2 \\le \\kappa \\, V(S)\\)</span> holds</p>'
            '<div class="arithmatex">\\[\\kappa \\ge \\frac{f}{n - 2f}\\]</div>')
    out = hooks.render_math(html)
    assert out.count("<math") == 2 and 'display="block"' in out and "arithmatex" not in out
    assert "\\(" not in out and "\\[" not in out
    assert "<mfrac>" in out  # the fraction is real MathML, not text
    # HTML-escaped TeX (arithmatex escapes <, >, &) is unescaped before conversion
    assert "<math" in hooks.render_math('<span class="arithmatex">\\(a &lt; b\\)</span>')


def test_figures_open_full_size() -> None:
    hooks = _hooks()
    html = ('<p><img alt="heatmap" src="../img/experiments/accuracy_heatmap.png" /></p>'
            '<p><a href="x.html"><img alt="logo" src="logo.png" /></a></p>')
    out = hooks.link_figures(html)
    assert '<a class="figure-full" href="../img/experiments/accuracy_heatmap.png" target="_blank">' in out
    assert out.count("<a ") == 2  # an image that is already a link is left alone


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.mark.slow
def test_built_site_renders_math_offline_scrolls_tables_and_links_figures(site: Path) -> None:
    assumptions = (site / "assumptions" / "index.html").read_text(encoding="utf-8")
    metrics = (site / "metrics" / "index.html").read_text(encoding="utf-8")
    for page in (assumptions, metrics):
        assert "<math" in page and 'class="arithmatex"' not in page
    assert "<code>‖F(X) − x̄_S‖² ≤ κ · V(S)</code>" not in assumptions  # it was a code span
    # nothing is fetched from another host when the page is viewed: no remote script, style or font
    for html in site.rglob("*.html"):
        text = html.read_text(encoding="utf-8")
        remote = re.findall(r'<(?:script|link)[^>]+(?:src|href)="(https?://[^"]+)"', text)
        assert not remote, (html, remote)
        assert "fonts.googleapis" not in text and "fonts.gstatic" not in text, html
    css = (site / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    assert "overflow-x: auto" in css and "white-space: nowrap" in css
    assert "stylesheets/extra.css" in assumptions
    results = (site / "results" / "index.html").read_text(encoding="utf-8")
    assert 'class="figure-full" href="fmnist_benchmark/worst_case_heatmap.png"' in results
