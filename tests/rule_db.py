"""The rule database that drives the generic aggregator tests.

One :class:`RuleSpec` per configuration under test: how to build it for a given ``f`` (sample
kwargs), the smallest ``n`` it accepts, its independent float64 reference (:mod:`reference`),
and the properties it declares. The declarations here are written from the definitions in
``shared/design/conventions.md``, not read back from the library, so a rule that silently changes
its behaviour or its class flags fails a test.

:data:`ERROR_CASES` lists bad inputs with the exception type and a regex on the message, so that
every message the library generates is pinned.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

import reference as R
import robustagg as ra

__all__ = ["examples", "KINDS", "make_input", "RuleSpec", "RULES", "RULE_IDS", "MAPS", "ErrorCase", "ERROR_CASES",
           "FIX", "requirement_regex", "rule_by_name"]

#: Multiplies every hypothesis example budget (``ROBUSTAGG_EXAMPLES=10`` for a local bug hunt).
_EXAMPLES_SCALE = float(os.environ.get("ROBUSTAGG_EXAMPLES", "1"))


def examples(k: int) -> int:
    """Hypothesis ``max_examples`` for a test whose CI budget is ``k``."""
    return max(1, int(round(k * _EXAMPLES_SCALE)))


#: Input kinds of :func:`make_input`.
KINDS = ("gauss", "ints", "dups", "outliers")


def make_input(kind: str, n: int, d: int, f: int, seed: int) -> np.ndarray:
    """A float64 ``(n, d)`` input of the given kind (exactly representable in float32 for ``ints``)."""
    rng = np.random.default_rng(seed)
    if kind == "ints":
        return rng.integers(-3, 4, size=(n, d)).astype(np.float64)
    scale = float(rng.choice([1e-3, 1.0, 1e3]))
    x = rng.normal(size=(n, d)) * scale + rng.normal(size=d) * scale
    if kind == "dups":  # every row copies a random earlier row (or keeps its own)
        src = np.minimum(rng.integers(0, n, size=n), np.arange(n))
        x = x[src]
    elif kind == "outliers" and min(f, n // 2) > 0:
        k = min(f, n // 2)
        x[rng.choice(n, size=k, replace=False)] += rng.choice([-1.0, 1.0], size=(k, d)) * scale * 1e4
    return x


#: The fix every requirement violation ends with.
FIX = r"Lower f, add workers, or pass strict=False to study breakdown\."

GM_ITERS = 30  # fixed Weiszfeld iterations for the GM fast-vs-reference comparison
CC_TAU, CC_ITERS = 1.5, 3


@dataclass(frozen=True)
class RuleSpec:
    """One rule configuration and what it promises.

    Attributes:
        name: registry name or pipeline spec (``"nnm>trimmed_mean"``); also the test id.
        kwargs: sample keyword arguments besides ``f``.
        min_n: smallest ``n`` for a given ``f`` (the requirement, written independently).
        reference: ``(x, f) -> (d,)`` float64 reference of exactly this configuration (``None``: the
            configuration is compared in a dedicated test instead).
        display: the rule's display name in messages; ``inequality``: its printed requirement.
        permutation_invariant: output unchanged under row permutations (inputs without ties).
        translation_equivariant: ``F(X + c) = F(X) + c``.
        scale_equivariant: ``F(a X) = a F(X)`` for ``a > 0``.
        unanimous: all rows equal to r gives r.
        honest_range: with ``f`` rows pushed far away, every coordinate stays in the honest range.
        selects_rows: the output is one input row (``"row"``) or a mean of rows (``"mean"``), else ``""``.
        kappa_tested: the empirical kappa-hat is checked against the literature bound.
        max_n: largest ``n`` to test (MDA is exponential).
        paper_fragment: text the requirement's citation must contain.
        fresh: build a new instance for every call (stateful or randomised rules).
        seen: rows the final rule sees for ``n`` input rows (``ceil(n/s)`` after Bucketing(s)).
        tie_objective: ``(x, f, z) -> float`` for rules that break exact ties by row index; the
            permutation test accepts a different output only with an equal objective (an equally
            good choice among exactly tied candidates).
        objective: for rules defined as a minimiser, ``(x, f, z) -> float``; an output that differs
            from the reference passes only if its objective is no worse (up to rounding). The
            geometric median may stop early where its objective is flat (between the two middle
            points of an even number of collinear rows every point is a minimiser); ``nnm>krum``
            selects among mixed rows that tie exactly in real arithmetic (rows with the same
            neighbour set), which rounding of the mixed rows may order either way.
    """

    name: str
    kwargs: dict = field(default_factory=dict)
    min_n: Callable[[int], int] = lambda f: 2 * f + 1
    reference: Optional[Callable[[Any, int], np.ndarray]] = None
    display: str = ""
    inequality: str = ""
    permutation_invariant: bool = True
    translation_equivariant: bool = True
    scale_equivariant: bool = True
    unanimous: bool = True
    honest_range: bool = False
    selects_rows: str = ""
    kappa_tested: bool = False
    max_n: int = 40
    paper_fragment: str = ""
    fresh: bool = False
    objective: Optional[Callable[[Any, int, Any], float]] = None
    tie_objective: Optional[Callable[[Any, int, Any], float]] = None
    seen: Callable[[int], int] = lambda n: n

    def build(self, f: int, **extra: Any) -> Any:
        """A new instance for declared bound ``f`` (plus ``extra`` kwargs, e.g. ``strict=False``)."""
        return ra.get(self.name, f=f, **self.kwargs, **extra)

    def __str__(self) -> str:
        return self.name


def _bucket_perm(n: int) -> list[int]:
    # Bucketing's first permutation from a fresh default generator (seeded with 0).
    return torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()


def _gm_ref(x, f: int) -> np.ndarray:
    return R.weiszfeld(x, nu=1e-6, iterations=GM_ITERS, init="mean")


def _subsets_with_mean(x, size: int, z) -> list[tuple[int, ...]]:
    """Every subset of ``size`` rows of ``x`` whose mean is ``z`` (to float32 rounding)."""
    x64, z64 = R.as64(x), R.as64(z)
    tol = 1e-5 * (float(np.max(np.abs(x64))) + 1e-300)
    return [c for c in itertools.combinations(range(x64.shape[0]), size)
            if float(np.max(np.abs(R.mean(x64[list(c)]) - z64))) <= tol]


def _krum_tie_objective(x, f: int, z, m: int = 1, default_m: bool = False) -> float:
    """Sum of the Krum scores of the rows whose mean is ``z`` (``inf`` if no such rows)."""
    n = R.as64(x).shape[0]
    size = n - f if default_m else m
    scores = R.krum_scores(x, f)
    return min((sum(scores[i] for i in c) for c in _subsets_with_mean(x, size, z)), default=math.inf)


def _mda_tie_objective(x, f: int, z) -> float:
    """Squared diameter of the ``n - f`` rows whose mean is ``z`` (``inf`` if none)."""
    dist = R.dist_matrix(x)
    n = dist.shape[0]
    return min((max((dist[i, j] for i, j in itertools.combinations(c, 2)), default=0.0)
                for c in _subsets_with_mean(x, n - f, z)), default=math.inf)


def _smea_tie_objective(x, f: int, z) -> float:
    """Top covariance eigenvalue of the ``n - f`` rows whose mean is ``z`` (``inf`` if none)."""
    x64 = R.as64(x)
    return min((R.top_direction(x64[list(c)])[1]
                for c in _subsets_with_mean(x, x64.shape[0] - f, z)), default=math.inf)


DNC_SUB, DNC_ITERS = 2, 3  # a configuration whose rounds draw different coordinates when d > 2


def _dnc_ref(x, f: int, sub_dim: int = 10_000, iterations: int = 5) -> np.ndarray:
    """DnC's reference on the coordinates a fresh DnC (seed 0) draws (the sampler is shared, the math is not)."""
    from robustagg.functional.spectral import dnc_coordinates

    gen = torch.Generator().manual_seed(0)
    d = R.as64(x).shape[1]
    sets = [dnc_coordinates(d, sub_dim, gen).tolist() for _ in range(iterations)]
    return R.dnc(x, f, sets)


def _nnm_krum_score(x, f: int, z) -> float:
    """Krum score of ``z`` among the NNM-mixed rows of ``x`` (``inf`` if ``z`` is none of them)."""
    mixed = R.nnm(x, f)
    i = min(range(mixed.shape[0]), key=lambda j: R.sq_dist(mixed[j], R.as64(z)))
    scale = float(np.max(np.abs(mixed))) + 1e-300
    if float(np.max(np.abs(mixed[i] - R.as64(z)))) > 1e-5 * scale:
        return math.inf
    return R.krum_scores(mixed, f)[i]


# --- similarity-based rules (part 2): the seeded draws each class makes on a fresh instance ---------
def _signguard_columns(d: int, fraction: float = 0.1) -> tuple[int, int]:
    """SignGuard's first column sample from a fresh generator seeded with 0: ``(offset, stride)``."""
    stride = max(1, round(1.0 / fraction))
    return int(torch.randint(min(stride, d), (1,), generator=torch.Generator().manual_seed(0))), stride


def _signguard_ref(x, f: int, fraction: float = 0.1) -> np.ndarray:
    return R.signguard(x, *_signguard_columns(R.as64(x).shape[1], fraction))


def _fltrust_ref(x, f: int) -> np.ndarray:
    x64 = R.as64(x)
    return R.fltrust(x64[:-1], x64[-1])


RULES: list[RuleSpec] = [
    RuleSpec("mean", min_n=lambda f: 1, reference=lambda x, f: R.mean(x), display="Mean", inequality="f = 0",
             paper_fragment="baseline"),
    RuleSpec("coordinate_median", reference=R.coordinate_median, display="Coordinate-wise median",
             inequality="n >= 2f + 1", honest_range=True, kappa_tested=True, paper_fragment="Yin"),
    RuleSpec("trimmed_mean", reference=R.trimmed_mean, display="Trimmed mean", inequality="n >= 2f + 1",
             honest_range=True, kappa_tested=True, paper_fragment="Yin"),
    RuleSpec("meamed", reference=R.meamed, display="MeaMed", inequality="n >= 2f + 1", honest_range=True,
             paper_fragment="Xie"),
    RuleSpec("krum", min_n=lambda f: 2 * f + 3, reference=R.krum, display="Krum", inequality="n >= 2f + 3",
             honest_range=True, selects_rows="row", kappa_tested=True, paper_fragment="Blanchard",
             tie_objective=_krum_tie_objective),
    RuleSpec("multi_krum", min_n=lambda f: 2 * f + 3, reference=lambda x, f: R.multi_krum(x, f),
             display="Multi-Krum", inequality="n >= 2f + 3", honest_range=True, selects_rows="mean",
             paper_fragment="Blanchard", tie_objective=lambda x, f, z: _krum_tie_objective(x, f, z, default_m=True)),
    RuleSpec("multi_krum", kwargs={"m": 2}, min_n=lambda f: 2 * f + 3, reference=lambda x, f: R.multi_krum(x, f, 2),
             display="Multi-Krum", inequality="n >= 2f + 3 and m=2 <= n - f", honest_range=True,
             selects_rows="mean", paper_fragment="Blanchard", tie_objective=lambda x, f, z: _krum_tie_objective(x, f, z, 2)),
    # Bulyan's last selection rounds score with |R| - f - 2 <= 1 neighbours (0: every row scores 0
    # and the lowest index wins; 1: the two mutual nearest rows tie), so its output depends on the
    # row order for most inputs with f >= 1: not permutation invariant.
    RuleSpec("bulyan", min_n=lambda f: 4 * f + 3, reference=R.bulyan, display="Bulyan", inequality="n >= 4f + 3",
             honest_range=True, paper_fragment="El Mhamdi", permutation_invariant=False),
    RuleSpec("geometric_median", kwargs={"max_iter": GM_ITERS, "tol": 0.0}, reference=_gm_ref,
             display="Geometric median", inequality="n >= 2f + 1", scale_equivariant=False,  # nu does not scale
             paper_fragment="Pillutla", objective=lambda x, f, z: R.gm_objective(x, z)),
    RuleSpec("geometric_median", display="Geometric median",  # defaults: compared to the converged GM elsewhere
             inequality="n >= 2f + 1", scale_equivariant=False, kappa_tested=True, paper_fragment="Pillutla"),
    RuleSpec("centered_clipping", kwargs={"tau": CC_TAU, "iterations": CC_ITERS},
             reference=lambda x, f: R.centered_clipping(x, CC_TAU, CC_ITERS, np.zeros(R.as64(x).shape[1])),
             display="Centered clipping", inequality="n >= 2f + 1", translation_equivariant=False,
             scale_equivariant=False, unanimous=False, paper_fragment="Karimireddy", fresh=True),
    RuleSpec("mda", reference=R.mda, display="MDA", inequality="n >= 2f + 1", honest_range=True,
             selects_rows="mean", max_n=13, paper_fragment="El Mhamdi", tie_objective=_mda_tie_objective),
    RuleSpec("nnm>trimmed_mean", reference=lambda x, f: R.trimmed_mean(R.nnm(x, f), f), display="Trimmed mean",
             inequality="n >= 2f + 1", honest_range=True, kappa_tested=True, paper_fragment="Yin"),
    RuleSpec("nnm>krum", min_n=lambda f: 2 * f + 3, reference=lambda x, f: R.krum(R.nnm(x, f), f), display="Krum",
             inequality="n >= 2f + 3", honest_range=True, paper_fragment="Blanchard", objective=_nnm_krum_score),
    RuleSpec("bucketing>krum", kwargs={}, min_n=lambda f: 4 * f + 5,  # ceil(n/2) >= 2f + 3
             reference=lambda x, f: R.krum(R.bucketing(x, 2, _bucket_perm(R.as64(x).shape[0])), f),
             display="Krum", inequality="n >= 2f + 3", permutation_invariant=False, fresh=True,
             paper_fragment="Blanchard", seen=lambda n: math.ceil(n / 2)),
    RuleSpec("clipping>mean", kwargs={}, min_n=lambda f: 1,
             reference=lambda x, f: R.mean(R.clipping(x, 1.0)), display="Mean", inequality="f = 0",
             translation_equivariant=False, scale_equivariant=False, unanimous=False, paper_fragment="baseline"),
    RuleSpec("arc>trimmed_mean", reference=lambda x, f: R.trimmed_mean(R.arc(x, f), f), display="Trimmed mean",
             inequality="n >= 2f + 1", translation_equivariant=False, paper_fragment="Yin"),
    # --- CAF, SMEA, MoNNA, CGE, DnC ---
    RuleSpec("caf", reference=R.caf, display="CAF", inequality="n >= 2f + 1", honest_range=True,
             paper_fragment="Allouah"),
    RuleSpec("smea", reference=R.smea, display="SMEA", inequality="n >= 2f + 1", honest_range=True,
             selects_rows="mean", max_n=13, paper_fragment="Allouah", tie_objective=_smea_tie_objective),
    RuleSpec("monna", reference=lambda x, f: R.monna(x, f, 0), display="MoNNA", inequality="n >= 2f + 1",
             selects_rows="mean", permutation_invariant=False, paper_fragment="Farhadkhani"),
    RuleSpec("cge", reference=R.cge, display="CGE", inequality="n >= 2f + 1", honest_range=True,
             selects_rows="mean", translation_equivariant=False, paper_fragment="Gupta"),
    RuleSpec("dnc", reference=_dnc_ref, display="DnC", inequality="n >= 2f + 1", selects_rows="mean",
             paper_fragment="Shejwalkar", fresh=True),
    RuleSpec("dnc", kwargs={"sub_dim": DNC_SUB, "iterations": DNC_ITERS},
             reference=lambda x, f: _dnc_ref(x, f, DNC_SUB, DNC_ITERS), display="DnC", inequality="n >= 2f + 1",
             selects_rows="mean", paper_fragment="Shejwalkar", fresh=True),
    # similarity-based rules (part 2). Cosines and norm ratios ignore a translation; clusters and
    # thresholds scale with the rows; FLAME's noise and FoolsGold's sybil test are not unanimous.
    RuleSpec("signguard", reference=_signguard_ref, display="SignGuard", inequality="n >= 2f + 1",
             translation_equivariant=False, paper_fragment="Xu", fresh=True),
    RuleSpec("signguard", kwargs={"fraction": 1.0}, reference=lambda x, f: _signguard_ref(x, f, 1.0),
             display="SignGuard", inequality="n >= 2f + 1", translation_equivariant=False, paper_fragment="Xu"),
    RuleSpec("clipped_clustering", reference=lambda x, f: R.clipped_clustering(x), display="ClippedClustering",
             inequality="n >= 2f + 1", translation_equivariant=False, paper_fragment="Li", fresh=True),
    RuleSpec("flame", kwargs={"lam": 0.0}, reference=lambda x, f: R.flame(x), display="FLAME",
             inequality="n >= 2f + 1", translation_equivariant=False, paper_fragment="Nguyen"),
    RuleSpec("flame", display="FLAME", inequality="n >= 2f + 1", translation_equivariant=False, unanimous=False,
             paper_fragment="Nguyen", fresh=True),  # with noise: compared in a dedicated test
    RuleSpec("fltrust", kwargs={"root": "last_row"}, min_n=lambda f: 2, reference=_fltrust_ref, display="FLTrust",
             inequality="n >= 2", permutation_invariant=False, translation_equivariant=False,
             paper_fragment="Cao"),
    RuleSpec("foolsgold", min_n=lambda f: f + 1, reference=lambda x, f: R.foolsgold([x]), display="FoolsGold",
             inequality="n >= f + 1", translation_equivariant=False, unanimous=False, paper_fragment="Fung",
             fresh=True),
]

#: Test ids, unique per configuration.
RULE_IDS = [s.name + ("" if not s.kwargs else "(" + ",".join(f"{k}={v}" for k, v in s.kwargs.items()) + ")")
            for s in RULES]


def rule_by_name(name: str) -> RuleSpec:
    """The first spec registered under ``name`` (default kwargs)."""
    return next(s for s in RULES if s.name == name)


#: Pre-aggregation maps: name -> (build(f), reference(x, f) -> (m, d) array).
MAPS: dict[str, tuple[Callable[[int], Any], Callable[[Any, int], np.ndarray]]] = {
    "nnm": (lambda f: ra.NNM(f=f), R.nnm),
    "bucketing": (lambda f: ra.Bucketing(s=3, f=f), lambda x, f: R.bucketing(x, 3, _bucket_perm(R.as64(x).shape[0]))),
    "clipping": (lambda f: ra.Clipping(tau=1.0, f=f), lambda x, f: R.clipping(x, 1.0)),
    "arc": (lambda f: ra.ARC(f=f), R.arc),
}


def requirement_regex(display: str, inequality: str, paper_fragment: str, n: int, f: int) -> str:
    """The generated refusal: ``"<Rule> requires <ineq> (<paper>); got n=<n>, f=<f>. <fix>"``."""
    return (re.escape(f"{display} requires {inequality} (") + f"[^)]*{re.escape(paper_fragment)}[^)]*" +
            re.escape(f"); got n={n}, f={f}.") + " " + FIX)


# --- error inputs --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ErrorCase:
    """``call()`` must raise ``exc`` with a message matching ``match`` (``re.search``)."""

    id: str
    call: Callable[[], Any]
    exc: type
    match: str


def _x(n: int = 7, d: int = 3, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.arange(n * d, dtype=dtype).reshape(n, d)


def _nonfinite() -> torch.Tensor:
    x = _x()
    x[1, 0] = math.nan
    x[4, 2] = math.inf
    return x


def _register_twice() -> None:
    from robustagg.registry import register

    register("krum")(type("Dup", (), {}))


def _cc_wrong_centre() -> None:
    cc = ra.CenteredClipping(tau=1.0)
    cc.load_state_dict({"rule": "centered_clipping", "center": torch.zeros(5)})
    cc(_x())


_FINITE_FIX = r"drop or repair those submissions before aggregating"

ERROR_CASES: list[ErrorCase] = [
    # shapes and dtypes (robustagg._tensor)
    ErrorCase("1-D input", lambda: ra.Krum(f=0)(torch.zeros(5)), ra.ShapeError,
              r"^x must be a 2-D tensor of shape \(n, d\) \(one row per worker\); got shape \(5,\)\. "
              r"Stack flattened gradients with torch\.stack\.$"),
    ErrorCase("3-D input", lambda: ra.Mean()(torch.zeros(2, 3, 4)), ra.ShapeError, r"got shape \(2, 3, 4\)"),
    ErrorCase("zero columns", lambda: ra.Mean()(torch.zeros(3, 0)), ra.ShapeError,
              r"^x must have at least one row and one column; got shape \(3, 0\)\.$"),
    ErrorCase("zero rows", lambda: ra.Mean()(torch.zeros(0, 3)), ra.ShapeError,
              r"at least one row and one column; got shape \(0, 3\)"),
    ErrorCase("integer dtype", lambda: ra.CoordinateWiseMedian(f=1)(torch.ones(5, 2, dtype=torch.int64)),
              ra.ShapeError, r"^x must have a floating dtype; got torch\.int64\. Convert with x\.float\(\)\.$"),
    ErrorCase("empty list", lambda: ra.Mean()([]), ra.ShapeError,
              r"^x is empty: pass at least one submission \(a \(d,\) tensor\)\.$"),
    ErrorCase("list of 2-D", lambda: ra.Mean()([torch.zeros(2, 2)]), ra.ShapeError,
              r"^x as a list must hold \(d,\) tensors or NumPy arrays, one per worker; got a 2-D tensor of shape "
              r"\(2, 2\)\. Flatten each gradient first \(robustagg\.flatten\), or pass one \(n, d\) tensor\.$"),
    ErrorCase("list of non-tensors", lambda: ra.Mean()([[1.0, 2.0]]), ra.ShapeError,
              r"must hold \(d,\) tensors or NumPy arrays, one per worker; got a list\."),
    ErrorCase("integer NumPy array", lambda: ra.Mean()(np.ones((3, 2), dtype=np.int64)), ra.ShapeError,
              r"^x is a NumPy array of dtype int64; rules need floating values: pass x\.astype\(numpy\.float64\)\.$"),
    ErrorCase("ragged list", lambda: ra.Mean()([torch.zeros(3), torch.zeros(2)]), ra.ShapeError,
              r"^x rows have different lengths \[2, 3\]; every worker must submit the same d\.$"),
    ErrorCase("unflatten size", lambda: ra.unflatten_like(torch.zeros(5), [torch.zeros(2, 2)]), ra.ShapeError,
              r"^vector must be 1-D with 4 entries to match the parameters; got shape \(5,\)\.$"),
    # non-finite rows
    ErrorCase("nan and inf rows", lambda: ra.Krum(f=2)(_nonfinite()), ra.NonFiniteInputError,
              r"^x has non-finite values \(NaN or inf\) in rows \[1, 4\]; " + _FINITE_FIX),
    ErrorCase("nan in map", lambda: ra.NNM(f=1)(_nonfinite()), ra.NonFiniteInputError, r"in rows \[1, 4\]"),
    ErrorCase("nan in pipeline", lambda: ra.get("nnm>trimmed_mean", f=1)(_nonfinite()), ra.NonFiniteInputError,
              r"in rows \[1, 4\]"),
    ErrorCase("-inf float32", lambda: ra.Mean()(torch.tensor([[0.0], [-math.inf]])), ra.NonFiniteInputError,
              r"in rows \[1\]"),
    # hyperparameters
    ErrorCase("negative f", lambda: ra.Krum(f=-1), ra.ConfigError,
              r"^f must be a non-negative integer \(the declared Byzantine bound\); got -1\.$"),
    ErrorCase("float f", lambda: ra.CoordinateWiseTrimmedMean(f=1.5), ra.ConfigError, r"non-negative integer.*got 1\.5"),
    ErrorCase("bool f", lambda: ra.CoordinateWiseMedian(f=True), ra.ConfigError, r"non-negative integer.*got True"),
    ErrorCase("map negative f", lambda: ra.NNM(f=-2), ra.ConfigError, r"non-negative integer.*got -2"),
    ErrorCase("gm nu zero", lambda: ra.GeometricMedian(nu=0), ra.ConfigError,
              r"^Geometric median: nu must be a positive finite number; got 0\.$"),
    ErrorCase("gm nu inf", lambda: ra.GeometricMedian(nu=math.inf), ra.ConfigError, r"nu must be a positive finite"),
    ErrorCase("gm max_iter", lambda: ra.GeometricMedian(max_iter=0), ra.ConfigError,
              r"^Geometric median: max_iter must be an integer >= 1; got 0\.$"),
    ErrorCase("gm tol", lambda: ra.GeometricMedian(tol=1.0), ra.ConfigError,
              r"^Geometric median: tol must be a number in \[0, 1\); got 1\.0\.$"),
    ErrorCase("gm init", lambda: ra.GeometricMedian(init="median"), ra.ConfigError,
              r"^Geometric median: init must be 'mean' or 'zero'; got 'median'\.$"),
    ErrorCase("cc tau", lambda: ra.CenteredClipping(tau=-1.0), ra.ConfigError,
              r"^Centered clipping: tau must be a positive finite number; got -1\.0\.$"),
    ErrorCase("cc iterations", lambda: ra.CenteredClipping(iterations=2.5), ra.ConfigError,
              r"^Centered clipping: iterations must be an integer >= 1; got 2\.5\.$"),
    ErrorCase("cc centre length", _cc_wrong_centre, ra.ConfigError,
              r"^Centered clipping: stored centre has 5 entries but the submissions have d=3; "
              r"call reset\(\) when the model changes\.$"),
    ErrorCase("multi_krum m", lambda: ra.MultiKrum(f=1, m=0), ra.ConfigError,
              r"^Multi-Krum: m must be None or an integer >= 1; got 0\.$"),
    ErrorCase("mda max_subsets", lambda: ra.MinimumDiameterAveraging(max_subsets=0), ra.ConfigError,
              r"^MDA: max_subsets must be an integer >= 1; got 0\.$"),
    ErrorCase("mda too many subsets", lambda: ra.MinimumDiameterAveraging(f=3, max_subsets=100)(_x(n=10)),
              ra.ConfigError, r"^MDA: C\(n=10, f=3\) = 120 subsets exceeds max_subsets=100; raise max_subsets or use "
                              r"a polynomial rule \(krum, nnm\)\.$"),
    # CAF, SMEA, MoNNA, CGE, DnC
    ErrorCase("smea max_subsets", lambda: ra.SMEA(max_subsets=0), ra.ConfigError,
              r"^SMEA: max_subsets must be an integer >= 1; got 0\.$"),
    ErrorCase("smea too many subsets", lambda: ra.SMEA(f=3, max_subsets=100)(_x(n=10)), ra.ConfigError,
              r"^SMEA: C\(n=10, f=3\) = 120 subsets exceeds max_subsets=100; raise max_subsets or use a "
              r"polynomial rule \(caf, dnc\)\.$"),
    ErrorCase("monna trusted type", lambda: ra.MoNNA(trusted=-1), ra.ConfigError,
              r"^MoNNA: trusted must be a non-negative row index; got -1\.$"),
    ErrorCase("monna trusted beyond n", lambda: ra.MoNNA(f=1, trusted=7)(_x(n=7)), ra.ConfigError,
              r"^MoNNA: trusted=7 is not a row index for n=7 submissions; pass trusted < n\.$"),
    ErrorCase("dnc sub_dim", lambda: ra.DnC(sub_dim=0), ra.ConfigError,
              r"^DnC: sub_dim must be an integer >= 1; got 0\.$"),
    ErrorCase("dnc iterations", lambda: ra.DnC(iterations=1.5), ra.ConfigError,
              r"^DnC: iterations must be an integer >= 1; got 1\.5\.$"),
    ErrorCase("dnc c", lambda: ra.DnC(c=0.0), ra.ConfigError, r"^DnC: c must be a positive finite number; got 0\.0\.$"),
    ErrorCase("dnc seed", lambda: ra.DnC(seed="0"), ra.ConfigError, r"^DnC: seed must be an int; got '0'\.$"),
    ErrorCase("dnc foreign state", lambda: ra.DnC().load_state_dict({"rule": "bucketing"}), ra.ConfigError,
              r"^DnC: cannot load state of rule 'bucketing'\.$"),
    ErrorCase("bucketing s", lambda: ra.Bucketing(s=0), ra.ConfigError, r"^Bucketing: s must be an integer >= 1; got 0\.$"),
    ErrorCase("clipping tau", lambda: ra.Clipping(tau=0.0), ra.ConfigError,
              r"^Clipping: tau must be a positive finite number; got 0\.0\.$"),
    # state
    ErrorCase("foreign state", lambda: ra.CenteredClipping().load_state_dict({"rule": "krum"}), ra.ConfigError,
              r"^Centered clipping: cannot load state of rule 'krum'\.$"),
    ErrorCase("stateless foreign state", lambda: ra.Krum().load_state_dict({"rule": "mean"}), ra.ConfigError,
              r"^Krum: cannot load state of rule 'mean'\.$"),
    ErrorCase("map foreign state", lambda: ra.Bucketing().load_state_dict({"rule": "nnm"}), ra.ConfigError,
              r"^Bucketing: cannot load state of 'nnm'\.$"),
    # registry and pipelines
    ErrorCase("unknown name", lambda: ra.get("krumm", f=1), ra.ConfigError,
              r"^unknown aggregator 'krumm' \(did you mean krum\?\); available: .*\bkrum\b.*\bmulti_krum\b"
              r".*\btrimmed_mean\b.*\.$"),
    ErrorCase("unknown kwarg", lambda: ra.get("krum", f=1, m=3), ra.ConfigError,
              r"^krum: .*unexpected keyword argument 'm'.*\. See help\(robustagg\.Krum\) for its parameters\.$"),
    ErrorCase("trimmed_mean has no beta", lambda: ra.get("trimmed_mean", f=1, beta=0.1), ra.ConfigError,
              r"^trimmed_mean: .*'beta'.*help\(robustagg\.CoordinateWiseTrimmedMean\)"),
    ErrorCase("unknown name in pipeline", lambda: ra.get("nnm>krumm", f=1), ra.ConfigError,
              r"^unknown aggregator 'krumm' \(did you mean krum\?\); available: "),
    ErrorCase("unknown name, none near", lambda: ra.get("zzz", f=1), ra.ConfigError,
              r"^unknown aggregator 'zzz'; available: "),
    ErrorCase("unknown kwarg in pipeline", lambda: ra.get("nnm>krum", f=1, tau=2.0), ra.ConfigError,
              r"^krum: .*unexpected keyword argument 'tau'.*See help\(robustagg\.Krum\) for its parameters\.$"),
    ErrorCase("map last", lambda: ra.get("krum>nnm", f=1), ra.ConfigError,
              r"^krum>nnm: expected pre-aggregation maps then one rule, e\.g\. 'nnm>trimmed_mean'\.$"),
    ErrorCase("pre_params length", lambda: ra.build_pipeline("nnm>krum", f=1, pre_params=[{}, {}]), ra.ConfigError,
              r"^nnm>krum: pre_params needs one dict per pre-aggregation map \(1\)\.$"),
    ErrorCase("pipeline rule type", lambda: ra.Pipeline(pre=[], rule=ra.NNM(f=1)), ra.ConfigError,
              r"^Pipeline: rule must be a robustagg Aggregator; got NNM\(f=1\)\.$"),
    ErrorCase("pipeline pre type", lambda: ra.Pipeline(pre=[ra.Krum(f=1)], rule=ra.Mean()), ra.ConfigError,
              r"^Pipeline: pre must hold pre-aggregation maps \(nnm, bucketing, clipping, arc\); got \[Krum\(f=1\)\]\.$"),
    ErrorCase("duplicate registration", _register_twice, ValueError,
              r"^robustagg registry already has 'krum' \(Krum\)\.$"),
    # similarity-based rules (part 2)
    ErrorCase("signguard band", lambda: ra.SignGuard(lower=2.0), ra.ConfigError,
              r"^SignGuard: need lower < 1 < upper \(the band is open and the median row must pass\); got lower=2\.0, "
              r"upper=3\.0\.$"),
    ErrorCase("signguard closed band", lambda: ra.SignGuard(lower=1.0), ra.ConfigError,
              r"^SignGuard: need lower < 1 < upper \(the band is open and the median row must pass\); got lower=1\.0, "
              r"upper=3\.0\.$"),
    ErrorCase("signguard fraction", lambda: ra.SignGuard(fraction=1.5), ra.ConfigError,
              r"^SignGuard: fraction must be in \(0, 1\]; got 1\.5\.$"),
    ErrorCase("signguard seed", lambda: ra.SignGuard(seed=-1), ra.ConfigError,
              r"^SignGuard: seed must be a non-negative integer; got -1\.$"),
    ErrorCase("flame lam", lambda: ra.FLAME(lam=-0.1), ra.ConfigError,
              r"^FLAME: lam must be a finite number >= 0; got -0\.1\.$"),
    ErrorCase("flame min_samples", lambda: ra.FLAME(min_samples=0), ra.ConfigError,
              r"^FLAME: min_samples must be an integer >= 1; got 0\.$"),
    ErrorCase("fltrust root", lambda: ra.FLTrust(root="first_row"), ra.ConfigError,
              r"^FLTrust: root must be 'given' \(call set_trusted\(g0\) before each call\) or 'last_row' "
              r"\(the last row of x is g0\); got 'first_row'\.$"),
    ErrorCase("fltrust without trusted update", lambda: ra.FLTrust()(_x()), ra.ConfigError,
              r"^FLTrust: no trusted server update; call rule\.set_trusted\(g0\) .*server\.root_samples.*"
              r"root='last_row'.*\.$"),
    ErrorCase("fltrust trusted length", lambda: _fltrust_wrong_length(), ra.ShapeError,
              r"^FLTrust: the trusted update has 5 entries but the submissions have d=3\.$"),
    ErrorCase("fltrust trusted nan", lambda: ra.FLTrust().set_trusted(torch.tensor([1.0, math.nan])), ra.ShapeError,
              r"^FLTrust: the trusted update holds NaN or inf; recompute it on the root data\.$"),
    ErrorCase("foolsgold kappa", lambda: ra.FoolsGold(kappa=0.0), ra.ConfigError,
              r"^FoolsGold: kappa must be a positive finite number; got 0\.0\.$"),
    ErrorCase("foolsgold history length", lambda: _foolsgold_wrong_d(), ra.ConfigError,
              r"^FoolsGold: stored history has d=5 but the submissions have d=3; call reset\(\) when the model "
              r"changes\.$"),
    ErrorCase("clipped_clustering foreign state",
              lambda: ra.ClippedClustering().load_state_dict({"rule": "flame"}), ra.ConfigError,
              r"^ClippedClustering: cannot load state of rule 'flame'\.$"),
]


def _fltrust_wrong_length() -> None:
    rule = ra.FLTrust()
    rule.set_trusted(torch.zeros(5, dtype=torch.float64))
    rule(_x())


def _foolsgold_wrong_d() -> None:
    rule = ra.FoolsGold()
    rule.load_state_dict({"rule": "foolsgold", "history": torch.zeros(7, 5, dtype=torch.float64)})
    rule(_x())
