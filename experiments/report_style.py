"""The report figures' fixed style: one colour per rule and per attack, the kappa-hat floor, formats.

This module is the single source of truth for how a name is drawn. A rule (or attack) gets the
same colour in every figure of every report, whatever else the sweep ran: the colour is looked up
by name in :data:`RULE_COLORS` / :data:`ATTACK_COLORS` (hex strings), never assigned by position
in the figure's own list of names. A name outside the tables (a rule of your own, a pipeline not
listed, a variant such as ``krum[m=3]``) gets a colour from :data:`EXTRA_COLORS`
picked by a stable hash of the name (SHA-1, not Python's salted ``hash``), so it too is the same in
every report.
"""

from __future__ import annotations

import hashlib

__all__ = ["RULE_COLORS", "ATTACK_COLORS", "EXTRA_COLORS", "rule_color", "attack_color", "KAPPA_FLOOR",
           "FIGURE_FORMATS", "MAX_COLUMNS"]

#: Colour of every rule and pipeline the shipped experiments run (tab10 first, then tab20's
#: darker shades and a few named colours, so that the rules of one sweep stay easy to tell apart).
RULE_COLORS: dict[str, str] = {
    "mean": "#1f77b4", "coordinate_median": "#ff7f0e", "trimmed_mean": "#2ca02c", "krum": "#d62728",
    "multi_krum": "#9467bd", "geometric_median": "#8c564b", "centered_clipping": "#e377c2",
    "nnm>trimmed_mean": "#7f7f7f", "bucketing>coordinate_median": "#bcbd22", "bulyan": "#17becf",
    "bucketing>krum": "#393b79", "nnm>krum": "#637939", "nnm>coordinate_median": "#8c6d31",
    "meamed": "#843c39", "mda": "#7b4173", "caf": "#3182bd", "smea": "#e6550d", "monna": "#31a354",
    "cge": "#756bb1", "dnc": "#636363", "signguard": "#6baed6", "clipped_clustering": "#fd8d3c",
    "flame": "#74c476", "fltrust": "#9e9ac8", "foolsgold": "#969696",
}

#: Colour of every attack (``none`` is black: the reference every other line is compared with).
ATTACK_COLORS: dict[str, str] = {
    "none": "#000000", "sign_flip": "#1f77b4", "alie": "#ff7f0e", "ipm": "#2ca02c", "min_max": "#d62728",
    "min_sum": "#9467bd", "label_flip": "#8c564b", "mimic": "#e377c2", "agr_tailored": "#7f7f7f",
    "opt_alie": "#bcbd22", "opt_ipm": "#17becf", "mpaf": "#393b79", "poisoned_fl": "#637939",
    "backdoor": "#8c6d31", "backdoor_dba": "#843c39", "model_replacement": "#7b4173", "gaussian": "#3182bd",
    "bit_flip": "#e6550d", "zero": "#31a354", "constant": "#756bb1", "large_norm": "#636363",
    "fang_krum": "#6baed6", "fang_trimmed_mean": "#fd8d3c",
}

#: Colours for names in neither table, chosen by a stable hash of the name.
EXTRA_COLORS: tuple[str, ...] = ("#5254a3", "#b5cf6b", "#e7ba52", "#d6616b", "#ce6dbd", "#9c9ede", "#cedb9c",
                                 "#e7969c", "#de9ed6", "#a55194")

#: kappa-hat values below this (a rule that returns the honest mean exactly gives ~1e-15, rounding
#: noise) are drawn at this floor on the log axis, which is labelled as "<= floor".
KAPPA_FLOOR = 1e-3

#: File formats ``python -m experiments.report --format`` writes the figures in.
FIGURE_FORMATS = ("png", "pdf", "svg")

#: At most this many panels in a row of any figure (so a figure fits a paper's page width).
MAX_COLUMNS = 3


def _stable(name: str) -> str:
    return EXTRA_COLORS[int(hashlib.sha1(name.encode()).hexdigest(), 16) % len(EXTRA_COLORS)]


def _lookup(name: str, table: dict[str, str]) -> str:
    return table.get(name) or _stable(name)


def rule_color(name: str) -> str:
    """The colour (hex ``#rrggbb``) of the rule or pipeline ``name``, the same in every figure.

    Example:
        >>> rule_color("krum"), rule_color("krum") == rule_color("krum")
        ('#d62728', True)
    """
    return _lookup(name, RULE_COLORS)


def attack_color(name: str) -> str:
    """The colour (hex ``#rrggbb``) of the attack ``name``, the same in every figure.

    Example:
        >>> attack_color("none"), attack_color("alie")
        ('#000000', '#ff7f0e')
    """
    return _lookup(name, ATTACK_COLORS)
