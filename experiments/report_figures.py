"""The report's figures (matplotlib, Agg backend, PNG written atomically).

- :func:`accuracy_heatmap`: final test accuracy (%), rule x attack, one panel per setting (and the
  attack success rate (%) next to every backdoor attack);
- :func:`tradeoff_scatter`: accuracy lost with no attack vs the mean (x, suppression) against
  accuracy lost to the worst attack (y, integrity), one point per rule, frontier marked;
- :func:`kappa_curves`: kappa-hat over training, one panel per rule, one line per attack, with the
  rule's literature bound and the lower bound ``f / (n - 2f)`` as horizontal lines, log y;
- :func:`learning_curves`: test accuracy (or loss) against the step, one panel per rule, one line
  per attack (mean over seeds) with the seeds' range as a band (:func:`curve_bands`);
- :func:`availability_vs_bias`: final accuracy, mean kappa-hat and the mean relative bias against
  the synchronous full-participation honest mean, against the participation fraction (or the
  staleness bound tau), one line per rule, solid without attack and dashed under it;
- :func:`weight_vs_skew`: each honest worker's share of the aggregate (relative to a fair ``1/n``)
  against its label skew, one panel per rule.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from .report_style import FIGURE_FORMATS, KAPPA_FLOOR, MAX_COLUMNS, attack_color, rule_color  # noqa: E402
from .report_tables import ATTACK_ORDER, RULE_ORDER, mean_grid, order  # noqa: E402

__all__ = ["rule_colors", "save_figure", "accuracy_heatmap", "tradeoff_scatter", "kappa_curves", "weight_vs_skew", "kappa_bounds",
           "curve_bands", "learning_curves", "availability_vs_bias", "MIN_SPAN_PP"]

_DPI = 110
#: The trade-off plot's axes span at least this many percentage points, so that a spread of a point
#: or two (seed noise on iid data) is not stretched across the whole panel.
MIN_SPAN_PP = 10.0


def save_figure(fig: Any, path: str | os.PathLike[str]) -> Path:
    """Save ``fig`` atomically (temp file in the same folder, fsync, rename), then close it; the
    format is the suffix of ``path`` (``.png``, ``.pdf`` or ``.svg``, :data:`FIGURE_FORMATS`).

    Raises:
        ValueError: another suffix.
    """
    from .report_load import write_atomic

    fmt = Path(path).suffix.lstrip(".").lower()
    if fmt not in FIGURE_FORMATS:
        plt.close(fig)
        raise ValueError(f"save_figure: the figure format must be one of {', '.join(FIGURE_FORMATS)}; got {path!s}.")

    def write(tmp: str) -> None:
        # no creation date in PDF/SVG: the same figure gives the same bytes
        meta = {"CreationDate": None} if fmt == "pdf" else {"Date": None} if fmt == "svg" else None
        fig.savefig(tmp, format=fmt, dpi=_DPI, bbox_inches="tight", metadata=meta)

    try:
        return write_atomic(path, write)
    finally:
        plt.close(fig)


def _grid(k: int, cols: int, w: float, h: float, *, share: bool = False) -> tuple[Any, np.ndarray]:
    """``k`` panels, at most ``min(cols, MAX_COLUMNS)`` a row; ``share``: one x and one y range for
    all of them (panels that are compared), tick labels kept on the lowest panel of every column."""
    ncols = max(1, min(cols, MAX_COLUMNS, k))
    nrows = max(1, math.ceil(k / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows), squeeze=False, layout="constrained",
                             sharex=share, sharey=share)
    for ax in axes.flat[k:]:
        ax.set_visible(False)
    if share:
        for i, ax in enumerate(axes.flat[:k]):
            if i + ncols >= k:  # nothing visible below it: its x tick labels stay
                ax.xaxis.set_tick_params(labelbottom=True)
    return fig, axes


def _label_outer(axes: np.ndarray, k: int, xlabel: str, ylabel: str) -> None:
    """Axis titles only where they are needed on a shared grid: y on the first column, x on the
    lowest visible panel of each column."""
    ncols = axes.shape[1]
    for i, ax in enumerate(axes.flat[:k]):
        ax.set_ylabel(ylabel if i % ncols == 0 else "")
        ax.set_xlabel(xlabel if i + ncols >= k else "")


def rule_colors(rules: Sequence[str]) -> dict[str, Any]:
    """Each rule's fixed colour (hex, :func:`experiments.report_style.rule_color`), in ``RULE_ORDER``:
    a rule has the same colour in every figure, whichever other rules the sweep ran."""
    return {r: rule_color(r) for r in order(rules, RULE_ORDER)}


def _legend(fig: Any, handles: dict[str, Any], ncol: int) -> None:
    if handles:
        fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center",
                   ncol=min(ncol, len(handles)), fontsize=8)


def _plain_log_axis(ax: Any) -> None:
    """Short decimal tick labels (``0.3``, ``1e-06``) on a log y axis; call after plotting. Minor
    ticks are labelled too when the axis spans less than 1.5 decades (else it may show no label)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    def two_five(v: float, _: Any) -> str:
        if v <= 0:
            return ""
        lead = v / 10 ** math.floor(math.log10(v) + 1e-9)
        return f"{v:.3g}" if min(abs(lead - 2), abs(lead - 5)) < 1e-6 else ""

    lo, hi = ax.get_ylim()
    span = math.log10(hi / lo) if lo > 0 and hi > lo else 99.0
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    if span < 0.5:
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    elif span < 2.0:
        ax.yaxis.set_minor_formatter(FuncFormatter(two_five))
    else:
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.tick_params(axis="y", which="minor", labelsize=7)


def _with_asr(runs: pd.DataFrame, setting: str) -> tuple[pd.DataFrame, list[bool]]:
    """The setting's accuracy grid (%) with an ``"<attack> ASR"`` column (%) after every attack whose
    runs logged an attack success rate (the backdoors); and which columns are ASR columns."""
    acc = mean_grid(runs, "final_acc", setting) * 100.0
    if "final_asr" not in runs:
        return acc, [False] * acc.shape[1]
    asr = mean_grid(runs, "final_asr", setting) * 100.0
    cols: dict[str, pd.Series] = {}
    is_asr: list[bool] = []
    for attack in acc.columns:
        cols[attack] = acc[attack]
        is_asr.append(False)
        if attack in asr and asr[attack].notna().any():
            cols[f"{attack} ASR"] = asr[attack]
            is_asr.append(True)
    return pd.DataFrame(cols, index=acc.index), is_asr


def accuracy_heatmap(runs: pd.DataFrame, settings: Sequence[str]) -> Any:
    """Final test accuracy (%) as a rule x attack heatmap, one panel per setting (mean over seeds;
    grey "skip" where the configuration broke a requirement, grey "n/a" where no run finished).

    Backdoor attacks get an extra ``"<attack> ASR"`` column right after theirs: the final attack
    success rate (%, ``test/asr``; red, higher = the backdoor took) next to the clean accuracy."""
    fig, axes = _grid(len(settings), 2, 7.2, 5.2)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#d9d9d9")
    reds = matplotlib.colormaps["Reds"].with_extremes(bad=(0, 0, 0, 0))
    image = asr_image = None
    for ax, setting in zip(axes.flat, settings):
        grid, is_asr = _with_asr(runs, setting)
        sub = runs[runs["setting"] == setting]
        values = grid.to_numpy(dtype=float)
        mask = np.array(is_asr, dtype=bool)[None, :].repeat(values.shape[0], axis=0)
        image = ax.imshow(np.where(mask, np.nan, values), cmap=cmap, vmin=0.0, vmax=100.0, aspect="auto")
        if mask.any():
            asr_image = ax.imshow(np.where(mask, values, np.nan), cmap=reds, vmin=0.0, vmax=100.0, aspect="auto")
        ax.set_xticks(range(grid.shape[1]), grid.columns, rotation=40, ha="right")
        ax.set_yticks(range(grid.shape[0]), grid.index)
        for i, rule in enumerate(grid.index):
            for j, column in enumerate(grid.columns):
                v = grid.iloc[i, j]
                attack = column[:-len(" ASR")] if is_asr[j] else column
                cell = sub[(sub["rule"] == rule) & (sub["attack"] == attack)]
                if math.isfinite(v):
                    mark = "†" if (cell["status"] == "diverged").any() else ""
                    dark = v > 60 if is_asr[j] else v < 60
                    ax.text(j, i, f"{v:.0f}{mark}", ha="center", va="center", fontsize=8,
                            color="white" if dark else "black")
                else:
                    skipped = len(cell) and (cell["status"] == "skipped").all()
                    ax.text(j, i, "skip" if skipped else "n/a", ha="center", va="center", fontsize=7, color="#555555")
        ax.set_xlabel("attack")
        ax.set_ylabel("rule")
        ax.set_title(f"final test accuracy (%) — {setting}", fontsize=10)
    if image is not None:
        fig.colorbar(image, ax=list(axes.flat[:len(settings)]), label="final test accuracy (%)", shrink=0.8)
    if asr_image is not None:
        fig.colorbar(asr_image, ax=list(axes.flat[:len(settings)]), label="backdoor attack success rate (%)",
                     shrink=0.8)
    fig.suptitle("final test accuracy (%), mean over seeds; † some runs diverged (scored at chance, 1/C); "
                 "grey: skipped (requirement broken) or not run; red \"ASR\" columns: backdoor success rate (%)",
                 fontsize=10)
    return fig


def tradeoff_scatter(trade: pd.DataFrame, settings: Sequence[str]) -> Any:
    """Suppression (x) against integrity (y) per rule, in percentage points, one panel per setting.

    Error bars: standard deviation over seeds. The Pareto frontier (lower-left is better on both)
    is drawn as a dashed step line through the rules on it, which are circled.
    """
    fig, axes = _grid(len(settings), 2, 6.4, 5.0, share=True)
    rules = order(trade["rule"], RULE_ORDER)
    colors = rule_colors(rules)
    handles: dict[str, Any] = {}
    finite = trade[np.isfinite(trade["suppression_loss"].astype(float)) & np.isfinite(trade["integrity_loss"].astype(float))]
    finite = finite[finite["setting"].isin(settings)]
    placements: list[tuple[Any, list[tuple[float, float, str]]]] = []
    for ax, setting in zip(axes.flat, settings):
        sub = finite[finite["setting"] == setting]
        points = []
        for _, row in sub.iterrows():
            x, y = 100.0 * row["suppression_loss"], 100.0 * row["integrity_loss"]
            xe = 100.0 * row["suppression_std"] if math.isfinite(row["suppression_std"]) else None
            ye = 100.0 * row["integrity_std"] if math.isfinite(row["integrity_std"]) else None
            color = colors[row["rule"]]
            ax.errorbar(x, y, xerr=xe, yerr=ye, fmt="none", ecolor=color, capsize=3, lw=1.4, zorder=2)
            h = ax.plot(x, y, "o", color=color, ms=7, zorder=3)[0]
            handles.setdefault(row["rule"], h)
            if row["frontier"]:
                ax.plot(x, y, "o", ms=15, mfc="none", mec="black", mew=1.2, zorder=3)
            points.append((x, y, str(row["rule"])))
        placements.append((ax, points))
        front = sub[sub["frontier"].astype(bool)].sort_values("suppression_loss")
        if len(front):
            fx = 100.0 * front["suppression_loss"].to_numpy(dtype=float)
            fy = 100.0 * front["integrity_loss"].to_numpy(dtype=float)
            line, = ax.step(fx, fy, where="post", ls="--", color="black", lw=1)
            handles.setdefault("frontier (Pareto)", line)
        ax.axhline(0, color="#999999", lw=0.6)
        ax.axvline(0, color="#999999", lw=0.6)
        ax.set_title(f"integrity vs suppression — {setting}", fontsize=10)
        ax.grid(alpha=0.3)
    _label_outer(axes, len(settings), "suppression: accuracy lost with no attack vs the mean (pp)",
                 "integrity: accuracy lost to the worst attack (pp)")
    ax0 = axes.flat[0]
    ax0.set_xlim(*_span(100.0 * finite["suppression_loss"].to_numpy(dtype=float),
                        100.0 * finite["suppression_std"].to_numpy(dtype=float)))
    ax0.set_ylim(*_span(100.0 * finite["integrity_loss"].to_numpy(dtype=float),
                        100.0 * finite["integrity_std"].to_numpy(dtype=float)))
    keyed = {r: handles[r] for r in rules if r in handles}
    keyed.update({k: v for k, v in handles.items() if k not in keyed})
    _legend(fig, keyed, 4)
    fig.suptitle("integrity vs suppression per rule (lower-left is better: little accuracy thrown away, "
                 "little lost to attacks; error bars: sd over seeds; circled = on the frontier)", fontsize=10)
    fig.canvas.draw()  # lay the figure out first: labels are placed in its final pixels
    for ax, points in placements:
        _label_points(ax, points)
    return fig


def _span(values: np.ndarray, errors: np.ndarray) -> tuple[float, float]:
    """An axis range holding every value with its error bar and 0, at least :data:`MIN_SPAN_PP`
    wide (centred on the data), with a 8 % margin."""
    err = np.where(np.isfinite(errors), errors, 0.0)
    lo = float(np.min(np.append(values - err, 0.0)))
    hi = float(np.max(np.append(values + err, 0.0)))
    if hi - lo < MIN_SPAN_PP:
        mid = (hi + lo) / 2.0
        lo, hi = mid - MIN_SPAN_PP / 2.0, mid + MIN_SPAN_PP / 2.0
    pad = 0.08 * (hi - lo)
    return lo - pad, hi + pad


#: Where a point's label may go, in points from the point: right, left, above, below, then the
#: diagonals, each tried at growing distances (with a leader line beyond the first ring).
_SPOTS = ((8, -3), (-8, -3), (0, 8), (0, -13), (8, 7), (-8, 7), (8, -12), (-8, -12))


def _label_points(ax: Any, points: list[tuple[float, float, str]]) -> None:
    """Name each point next to it: every label takes the first spot (:data:`_SPOTS`, then the same
    directions farther out) whose rendered box lies inside the panel and overlaps no label placed
    before it and no point's marker. Call after the figure is laid out (``fig.canvas.draw()``); labels are kept out
    of the layout so they cannot move it."""
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    if not points:
        return
    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)  # a label stays inside its panel
    marker = 5.0 * ax.figure.dpi / 72.0  # half a 7-pt marker plus a little air, in pixels
    centres = [ax.transData.transform((x, y)) for x, y, _ in points]
    taken: list[Any] = [Bbox.from_extents(cx - marker, cy - marker, cx + marker, cy + marker) for cx, cy in centres]
    for (x, y, text) in sorted(points, key=lambda p: (-p[1], p[0])):
        ann = None
        for ring in range(1, 12):
            for dx, dy in _SPOTS:
                ox, oy = dx * ring if dx else 0, dy * ring if dy else 0
                ha = "left" if ox > 0 else "right" if ox < 0 else "center"
                ann = ax.annotate(text, (x, y), textcoords="offset points", xytext=(ox, oy), fontsize=7, ha=ha,
                                  arrowprops=dict(arrowstyle="-", color="#888888", lw=0.5) if ring > 1 else None,
                                  annotation_clip=False)
                ann.set_in_layout(False)
                ann.update_positions(renderer)  # else the text still sits at the offset's origin
                box = Text.get_window_extent(ann, renderer).expanded(1.04, 1.1)
                inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
                if inside and not any(box.overlaps(t) for t in taken):
                    taken.append(box)
                    break
                ann.remove()
                ann = None
            if ann is not None:
                break
        if ann is None:  # no free spot within 11 rings (hundreds of labels): the first spot
            ax.annotate(text, (x, y), textcoords="offset points", xytext=_SPOTS[0], fontsize=7).set_in_layout(False)


def kappa_bounds(rule: str, n: int, f: int) -> tuple[float, float]:
    """``(literature kappa bound, lower bound f/(n-2f))`` for the rule named ``rule`` at ``(n, f)``.

    The literature bound is ``rule.requirement.kappa_bound(n, f)`` (``nan`` when none is known or
    the requirement fails); for ``nnm>F`` it is Allouah et al.'s composition
    ``(8f/(n-f)) (kappa_F + 1)`` (Allouah et al., AISTATS 2023; design note conventions.md), which
    the Pipeline does not carry.

    Example:
        >>> [round(v, 3) for v in kappa_bounds("krum", 10, 2)]  # 6 (1 + 2/6) = 8; 2 / 6
        [8.0, 0.333]
    """
    import robustagg as ra

    base = rule.split("[", 1)[0]
    lower = ra.lower_bound_kappa(n, f)
    try:
        obj = ra.get(base, f=f, strict=False)
    except Exception:  # noqa: BLE001 - unknown names have no bound
        return math.nan, lower
    bound = obj.requirement.kappa_bound(n, f)
    stages = base.split(">")
    if math.isnan(bound) and len(stages) == 2 and stages[0] == "nnm" and n > f:
        inner = ra.get(stages[1], f=f, strict=False).requirement.kappa_bound(n, f)
        bound = (8.0 * f / (n - f)) * (inner + 1.0) if math.isfinite(inner) else math.nan
    return float(bound), float(lower)


def _smooth(steps: np.ndarray, values: np.ndarray, bins: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """Median of ``values`` in up to ``bins`` equal step bins (robust to kappa-hat's heavy tail)."""
    if len(steps) == 0:
        return steps, values
    edges = np.linspace(steps.min(), steps.max() + 1, min(bins, len(np.unique(steps))) + 1)
    idx = np.clip(np.digitize(steps, edges) - 1, 0, len(edges) - 2)
    xs, ys = [], []
    for b in range(len(edges) - 1):
        sel = idx == b
        if sel.any():
            xs.append(float(np.median(steps[sel])))
            ys.append(float(np.median(values[sel])))
    return np.asarray(xs), np.asarray(ys)


def kappa_curves(runs: pd.DataFrame, kappa: pd.DataFrame, setting: str,
                 bounds: Callable[[str, int, int], tuple[float, float]] = kappa_bounds) -> Optional[Any]:
    """kappa-hat over training for one setting: a panel per rule, a line per attack (median over
    seeds and step bins), the rule's literature bound (red dashed) and ``f/(n-2f)`` (black dotted)."""
    sub = runs[(runs["setting"] == setting) & (runs["status"] == "ok")]
    data = kappa.merge(sub[["run_id", "rule", "attack", "n", "f"]], on="run_id")
    data = data[np.isfinite(data["kappa_hat"].astype(float)) & (data["kappa_hat"].astype(float) >= 0)]
    if data.empty:
        return None
    rules = order(data["rule"], RULE_ORDER)
    attacks = order(data["attack"], ATTACK_ORDER)
    fig, axes = _grid(len(rules), 3, 4.2, 3.3, share=True)
    handles: dict[str, Any] = {}
    lowest = math.inf
    floored = False
    for ax, rule in zip(axes.flat, rules):
        rd = data[data["rule"] == rule]
        for attack in attacks:
            ad = rd[rd["attack"] == attack]
            if ad.empty:
                continue
            values = ad["kappa_hat"].to_numpy(dtype=float)
            floored |= bool((values < KAPPA_FLOOR).any())
            xs, ys = _smooth(ad["step"].to_numpy(dtype=float), np.maximum(values, KAPPA_FLOOR))
            lowest = min(lowest, float(ys.min()))
            line, = ax.plot(xs, ys, color=attack_color(attack), lw=1.3)
            handles.setdefault(f"attack: {attack}", line)
        n, f = int(rd["n"].iloc[0]), int(rd["f"].iloc[0])
        lit, low = bounds(rule, n, f)
        if math.isfinite(lit):
            h = ax.axhline(lit, color="red", ls="--", lw=1.2)
            handles.setdefault("literature upper bound on the rule's worst-case kappa", h)
        if math.isfinite(low) and low > 0:
            h = ax.axhline(low, color="black", ls=":", lw=1.2)
            handles.setdefault("f/(n-2f): no rule has a smaller worst-case kappa", h)
            lowest = min(lowest, low)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(rule if math.isfinite(lit) else f"{rule} (no known bound)", fontsize=9)
        ax.grid(alpha=0.3, which="both")
    ax0 = axes.flat[0]
    ax0.set_ylim(bottom=max(KAPPA_FLOOR, lowest) / 1.5)  # shared: every panel starts at the floor or above
    if floored:
        for ax in axes.flat[:len(rules)]:
            h = ax.axhline(KAPPA_FLOOR, color="#bbbbbb", lw=2.5, zorder=0)
        handles[f"kappa-hat <= {KAPPA_FLOOR:g} (numerically zero) drawn at {KAPPA_FLOOR:g}"] = h
    for ax in axes.flat[:len(rules)]:
        _plain_log_axis(ax)
    _label_outer(axes, len(rules), "training step", "kappa-hat (ratio, log scale)")
    fig.suptitle(f"empirical robustness coefficient kappa-hat = ||F(X) - mean_H||^2 / V(H) over training "
                 f"(median over seeds) — {setting}", fontsize=10)
    _legend(fig, handles, 4)
    return fig


def curve_bands(runs: pd.DataFrame, curves: pd.DataFrame, setting: str, metric: str) -> pd.DataFrame:
    """Per rule, attack and evaluation step of one setting: the ``mean``, ``low`` (minimum) and
    ``high`` (maximum) of ``metric`` (``acc`` or ``loss``) over the seeds, and how many ``seeds``
    were evaluated there; finished runs only (status ``ok``), non-finite values left out."""
    sub = runs[(runs["setting"] == setting) & (runs["status"] == "ok")]
    data = curves.merge(sub[["run_id", "rule", "attack"]], on="run_id")
    data = data[np.isfinite(data[metric].astype(float))]
    cols = ["rule", "attack", "step", "mean", "low", "high", "seeds"]
    if data.empty:
        return pd.DataFrame(columns=cols)
    g = data.assign(v=data[metric].astype(float)).groupby(["rule", "attack", "step"])["v"]
    out = pd.DataFrame({"mean": g.mean(), "low": g.min(), "high": g.max(), "seeds": g.size()}).reset_index()
    return out[cols]


def learning_curves(runs: pd.DataFrame, curves: pd.DataFrame, setting: str, metric: str = "acc") -> Optional[Any]:
    """Test accuracy (``metric="acc"``, in %) or test loss (``"loss"``, nats) against the training
    step for one setting: a panel per rule, a line per attack (mean over seeds), the seeds' range
    (minimum to maximum) as a shaded band; ``None`` when no run of the setting was evaluated."""
    bands = curve_bands(runs, curves, setting, metric)
    if bands.empty:
        return None
    scale = 100.0 if metric == "acc" else 1.0
    rules = order(bands["rule"], RULE_ORDER)
    attacks = order(bands["attack"], ATTACK_ORDER)
    fig, axes = _grid(len(rules), 3, 4.2, 3.3, share=True)
    handles: dict[str, Any] = {}
    for ax, rule in zip(axes.flat, rules):
        for attack in attacks:
            b = bands[(bands["rule"] == rule) & (bands["attack"] == attack)].sort_values("step")
            if b.empty:
                continue
            x = b["step"].to_numpy(dtype=float)
            color = attack_color(attack)
            line, = ax.plot(x, scale * b["mean"].to_numpy(dtype=float), color=color, lw=1.3,
                            marker="." if len(b) <= 40 else None)
            if (b["seeds"] > 1).any():
                ax.fill_between(x, scale * b["low"].to_numpy(dtype=float), scale * b["high"].to_numpy(dtype=float),
                                color=color, alpha=0.2, lw=0)
            handles.setdefault(f"attack: {attack}", line)
        ax.set_title(rule, fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    if metric == "acc":
        axes.flat[0].set_ylim(0.0, 100.0)  # accuracy: the whole scale, the same in every report
    _label_outer(axes, len(rules), "training step",
                 "test accuracy (%)" if metric == "acc" else "test loss (cross-entropy, nats)")
    what = "test accuracy" if metric == "acc" else "test loss"
    fig.suptitle(f"{what} over training (line: mean over seeds; band: the seeds' range) — {setting}", fontsize=10)
    _legend(fig, handles, 4)
    return fig


def weight_vs_skew(runs: pd.DataFrame, weights: pd.DataFrame, *, attack: str = "none") -> Optional[Any]:
    """Each honest worker's relative weight ``n * share`` (1 = fair share) against its label skew
    (total-variation distance of its label histogram from the pool's), runs with ``attack``; one
    panel per rule, one colour per setting, one point per (worker, seed)."""
    sub = runs[(runs["attack"] == attack) & (runs["status"] == "ok")]
    data = weights.merge(sub[["run_id", "rule", "setting"]], on="run_id")
    data = data[np.isfinite(data["label_skew"].astype(float)) & np.isfinite(data["rel_weight"].astype(float))]
    if data.empty:
        return None
    rules = order(data["rule"], RULE_ORDER)
    settings = list(dict.fromkeys(data["setting"]))
    colors = {s: matplotlib.colormaps["Set1"](i % 9) for i, s in enumerate(settings)}
    fig, axes = _grid(len(rules), 3, 4.0, 3.3, share=True)
    ymax = max(2.0, float(data["rel_weight"].max()) * 1.05)
    handles: dict[str, Any] = {}
    for ax, rule in zip(axes.flat, rules):
        rd = data[data["rule"] == rule]
        for s in settings:
            sd = rd[rd["setting"] == s]
            if len(sd):
                h = ax.scatter(sd["label_skew"], sd["rel_weight"], s=16, alpha=0.7, color=colors[s])
                handles.setdefault(s, h)
        fair = ax.axhline(1.0, color="black", ls=":", lw=1)
        handles.setdefault("fair share (weight 1/n)", fair)
        ax.set_ylim(-0.05, ymax)
        ax.set_xlim(-0.02, 1.0)
        ax.set_title(rule, fontsize=9)
        ax.grid(alpha=0.3)
    _label_outer(axes, len(rules), "label skew (TV distance to pool, 0-1)", "relative weight (n x share)")
    fig.suptitle(f"who gets suppressed: each honest worker's mean weight in the aggregate vs its label skew "
                 f"(attack: {attack}; one point per worker and seed)", fontsize=10)
    _legend(fig, handles, 4)
    return fig


def availability_vs_bias(runs: pd.DataFrame, axis: str = "participation") -> Optional[Any]:
    """What availability costs: three panels against ``axis`` (``"participation"``: the fraction of
    clients sampled per round; ``"tau"``: the staleness bound, in updates): final test accuracy (%),
    mean kappa-hat (log y) and mean ``agg/bias_vs_sync_rel`` (relative bias of the aggregate against
    the synchronous full-participation honest mean; log y). One colour per rule, a solid line with
    no attack, dashed under an attack (mean over seeds). ``None`` when fewer than two values of
    ``axis`` were run."""
    if axis not in runs or "status" not in runs:
        return None
    family = {"participation": "localrounds", "tau": "asyncsgd"}.get(axis)
    ok = runs[runs["status"] == "ok"]
    if family is not None and "protocol" in ok:  # one protocol per axis: never pool local and async runs
        ok = ok[ok["protocol"] == family]
    ok = ok[ok[axis].notna()]
    if ok.empty or ok[axis].nunique() < 2:
        return None
    rules = order(ok["rule"], RULE_ORDER)
    colors = rule_colors(rules)
    panels = [("final_acc", "final test accuracy (%)", 100.0, False),
              ("mean_kappa_hat", "mean kappa-hat", 1.0, True),
              ("mean_bias_vs_sync_rel", "mean relative bias vs synchronous", 1.0, True)]
    fig, axes = _grid(len(panels), 3, 4.2, 3.3)
    handles: dict[str, Any] = {}
    for ax, (col, label, scale, log) in zip(axes.flat, panels):
        if col not in ok:
            ax.set_visible(False)
            continue
        for rule in rules:
            for attacked in (False, True):
                sel = ok[(ok["rule"] == rule) & ((ok["attack"] != "none") == attacked)]
                g = sel.groupby(axis)[col].mean().dropna()
                if log:
                    g = g[g > 0]
                if g.empty:
                    continue
                line, = ax.plot(g.index.to_numpy(dtype=float), scale * g.to_numpy(dtype=float), color=colors[rule],
                                ls="--" if attacked else "-", marker="o", lw=1.3)
                handles.setdefault(rule, line)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("clients sampled per round (fraction of n)" if axis == "participation"
                      else "staleness bound tau (updates)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    attacks = sorted(a for a in ok["attack"].unique() if a != "none")
    fig.suptitle(f"availability against bias (solid: no attack; dashed: {', '.join(attacks) or 'none'})", fontsize=10)
    _legend(fig, handles, 4)
    return fig
