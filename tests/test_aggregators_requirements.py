"""Requirements, refusals and their messages, state, and the registry.

Every message the library generates is pinned by a regex: the error database (rule_db.ERROR_CASES)
covers shapes, non-finite rows, hyperparameters, state and the registry; the requirement messages
are generated per rule from the database's independently written inequality and paper.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch

import robustagg as ra
from robustagg.requirements import linear, lower_bound_kappa
from rule_db import ERROR_CASES, FIX, RULE_IDS, RULES, RuleSpec, requirement_regex

ADVISORY = {"mean", "clipping>mean"}
HARD = [s for s in RULES if s.name not in ADVISORY]


def _x(n: int, d: int = 3) -> torch.Tensor:
    return torch.arange(n * d, dtype=torch.float64).reshape(n, d) ** 1.5  # distinct, asymmetric rows


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c.id for c in ERROR_CASES])
def test_error_message(case):
    with pytest.raises(case.exc) as info:
        case.call()
    assert re.search(case.match, str(info.value)), f"{str(info.value)!r} does not match {case.match!r}"
    if case.exc is not ValueError:
        assert isinstance(info.value, ra.RobustAggError) and isinstance(info.value, ValueError)


# --- generated requirement messages, for every rule -------------------------------------------------------
@pytest.mark.parametrize("spec", HARD, ids=[RULE_IDS[RULES.index(s)] for s in HARD])
def test_requirement_violation_is_refused_with_the_generated_message(spec: RuleSpec):
    f = 2
    n = spec.min_n(f) - 1
    pattern = requirement_regex(spec.display, spec.inequality, spec.paper_fragment, spec.seen(n), f)
    rule = spec.build(f)
    with pytest.raises(ra.AssumptionError, match=pattern + "$"):
        rule.check(n)  # before any data exists
    with pytest.raises(ra.AssumptionError, match=pattern + "$"):
        rule(_x(n))
    assert rule.check(spec.min_n(f)) == []  # the bound is exactly the inequality
    assert rule(_x(spec.min_n(f))).shape == (3,)


@pytest.mark.parametrize("spec", HARD, ids=[RULE_IDS[RULES.index(s)] for s in HARD])
def test_strict_false_warns_records_and_runs(spec: RuleSpec):
    f = 2
    n = spec.min_n(f) - 1
    pattern = requirement_regex(spec.display, spec.inequality, spec.paper_fragment, spec.seen(n), f)
    rule = spec.build(f, strict=False)
    with pytest.warns(ra.AssumptionWarning, match=pattern):
        out = rule(_x(n))
    assert torch.isfinite(out).all() and out.shape == (3,)
    assert rule.last_violations and re.search(pattern.replace(" " + FIX, ""), " ".join(rule.last_violations))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a valid n neither warns nor keeps old violations
        rule(_x(spec.min_n(f)))
    assert rule.last_violations == []


@pytest.mark.parametrize("name", sorted(ADVISORY))
def test_mean_with_f_declared_only_warns(name):
    rule = ra.get(name, f=2)  # strict=True by default, still only a warning: the baseline
    x = _x(5)
    with pytest.warns(ra.AssumptionWarning,
                      match=r"^Mean requires f = 0 \(baseline \(no robustness\)\); got n=5, f=2\. "
                            r"\(advisory: the rule runs as the baseline\.\)$"):
        out = rule(x)
    if name == "mean":
        assert torch.allclose(out, x.mean(dim=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ra.Mean()(x)  # f = 0: silent
    assert ra.Mean(f=2).requirement.advisory


def test_every_violation_is_listed_together():
    # NNM(f=2) then Krum(f=2) at n=4: both stages fail; one error lists both, then the fix once.
    with pytest.raises(ra.AssumptionError) as info:
        ra.get("nnm>krum", f=2).check(4)
    msg = str(info.value)
    assert re.fullmatch(r"NNM requires n >= 2f \+ 1 \(Allouah et al\., AISTATS 2023\); got n=4, f=2\. "
                        r"Krum requires n >= 2f \+ 3 \(Blanchard et al\., NeurIPS 2017\); got n=4, f=2\. " + FIX, msg)
    assert ra.get("nnm>krum", f=2).violations(4) == [
        "NNM requires n >= 2f + 1 (Allouah et al., AISTATS 2023); got n=4, f=2.",
        "Krum requires n >= 2f + 3 (Blanchard et al., NeurIPS 2017); got n=4, f=2."]


def test_bucketing_then_krum_checks_the_bucket_count():
    # Bucketing(s=2) then Krum(f=2): Krum sees ceil(n/2) rows and needs ceil(n/2) >= 2f + 3 = 7.
    pipe = ra.Pipeline(pre=[ra.Bucketing(s=2)], rule=ra.Krum(f=2))
    assert pipe.check(13) == []  # ceil(13/2) = 7
    with pytest.raises(ra.AssumptionError, match=r"Krum requires n >= 2f \+ 3 .*; got n=6, f=2\. " + FIX):
        pipe.check(12)  # ceil(12/2) = 6 < 7, although 12 >= 7 raw rows
    assert ra.Krum(f=2).check(12) == []
    s3 = ra.build_pipeline("bucketing>krum", f=2, pre_params=[{"s": 3}])
    assert s3.check(19) == [] and s3.violations(18) == [
        "Krum requires n >= 2f + 3 (Blanchard et al., NeurIPS 2017); got n=6, f=2."]
    assert str(pipe.requirement) == "Bucketing then Krum: Krum: n >= 2f + 3"
    assert pipe(_x(13)).shape == (3,)


def test_multi_krum_m_above_n_minus_f_is_refused():
    rule = ra.MultiKrum(f=2, m=6)
    assert rule.check(8) == []  # n - f = 6
    with pytest.raises(ra.AssumptionError, match=r"^Multi-Krum requires n >= 2f \+ 3 and m=6 <= n - f "
                                                 r"\(Blanchard et al\., NeurIPS 2017\); got n=7, f=2\. " + FIX + "$"):
        rule(_x(7))
    assert ra.MultiKrum(f=2).check(7) == []  # default m = n - f always fits


# --- Requirement objects ------------------------------------------------------------------------------------
def test_requirement_is_printable():
    r = ra.Krum(f=2).requirement
    assert (r.rule, r.inequality, r.paper) == ("Krum", "n >= 2f + 3", "Blanchard et al., NeurIPS 2017")
    assert str(r) == "Krum: n >= 2f + 3 (Blanchard et al., NeurIPS 2017)"
    assert r.kappa_formula == "6(1 + f/(n-2f))"
    assert str(ra.Bulyan(f=1).requirement) == "Bulyan: n >= 4f + 3 (El Mhamdi et al., ICML 2018)"
    assert str(ra.CoordinateWiseTrimmedMean().requirement).startswith("Trimmed mean: n >= 2f + 1 (Yin")
    assert str(ra.MultiKrum(m=3).requirement) == "Multi-Krum: n >= 2f + 3 and m=3 <= n - f (Blanchard et al., NeurIPS 2017)"
    assert linear("Rule", 1, 2, "Someone 2020").inequality == "n >= f + 2"
    assert linear("Rule", 2, 3, "P").check(6, 2) == ["Rule requires n >= 2f + 3 (P); got n=6, f=2."]
    assert linear("Rule", 2, 3, "P").check(7, 2) == []


KAPPA_BY_HAND = [
    # (rule, n, f, value, arithmetic)
    (ra.Krum(f=2), 10, 2, 8.0),  # 6 (1 + 2/6) = 6 * 4/3 = 8
    (ra.CoordinateWiseMedian(f=2), 10, 2, 64.0 / 9.0),  # 4 (1 + 2/6)^2 = 4 * 16/9
    (ra.GeometricMedian(f=2), 10, 2, 64.0 / 9.0),  # same bound as CWMed
    (ra.CoordinateWiseTrimmedMean(f=2), 10, 2, 8.0 / 3.0),  # (6*2/6)(1 + 2/6) = 2 * 4/3
    (ra.CoordinateWiseTrimmedMean(f=1), 7, 1, 36.0 / 25.0),  # f/(n-2f) = 1/5: (6/5)(1 + 1/5) = 36/25
    (ra.get("nnm>trimmed_mean", f=2), 10, 2, 22.0 / 3.0),  # (8*2/8)(8/3 + 1) = 2 * 11/3
    (ra.get("nnm>krum", f=2), 10, 2, 18.0),  # (16/8)(8 + 1)
]


@pytest.mark.parametrize("rule,n,f,value", KAPPA_BY_HAND, ids=lambda v: repr(v) if isinstance(v, ra.Aggregator) else None)
def test_kappa_bound_by_hand(rule, n, f, value):
    assert rule.requirement.kappa_bound(n, f) == pytest.approx(value, rel=1e-15)


def test_kappa_bound_edges():
    assert math.isnan(ra.Krum(f=2).requirement.kappa_bound(6, 2))  # requirement broken: no bound
    assert math.isnan(ra.MeaMed(f=1).requirement.kappa_bound(5, 1))  # none stated in the literature
    assert math.isnan(ra.Bulyan(f=1).requirement.kappa_bound(7, 1))
    assert math.isnan(ra.get("bucketing>krum", f=1).requirement.kappa_bound(20, 1))
    assert lower_bound_kappa(10, 2) == pytest.approx(1.0 / 3.0) and lower_bound_kappa(4, 2) == math.inf
    for rule in (ra.Krum(), ra.CoordinateWiseMedian(), ra.CoordinateWiseTrimmedMean(), ra.GeometricMedian(),
                 ra.get("nnm>trimmed_mean", f=0)):
        for f in range(0, 5):
            for n in range(2 * f + 3, 2 * f + 20):  # no upper bound beats the universal lower bound
                assert rule.requirement.kappa_bound(n, f) >= lower_bound_kappa(n, f) - 1e-12


# --- state ------------------------------------------------------------------------------------------------
def test_centered_clipping_state_round_trip():
    x = _x(5)
    cc = ra.CenteredClipping(tau=2.0, iterations=2)
    assert cc.state_dict() == {"rule": "centered_clipping", "center": None}
    first = cc(x)
    state = cc.state_dict()
    state["center"].add_(100.0)  # the returned state is a copy
    assert torch.equal(cc.state_dict()["center"], first)
    second = cc(x)
    other = ra.CenteredClipping(tau=2.0, iterations=2)
    other.load_state_dict({"rule": "centered_clipping", "center": first.clone()})
    assert torch.equal(other(x), second)  # resumes exactly where cc was
    cc.reset()
    assert cc.state_dict()["center"] is None and torch.equal(cc(x), first)


def test_centered_clipping_centre_follows_the_input_dtype():
    cc = ra.CenteredClipping(tau=1.0, iterations=1)
    cc.load_state_dict({"rule": "centered_clipping", "center": torch.zeros(3, dtype=torch.float64)})
    out = cc(_x(5).float())
    assert out.dtype == torch.float32 and cc.state_dict()["center"].dtype == torch.float32


def test_stateless_rules_tag_and_check_their_state():
    for name in ("krum", "trimmed_mean", "geometric_median"):
        rule = ra.get(name, f=1)
        assert rule.state_dict() == {"rule": name}
        rule.load_state_dict(rule.state_dict())
        rule.reset()


def test_pipeline_state_restores_the_bucketing_permutation():
    x = _x(13)
    pipe = ra.get("bucketing>krum", f=2)
    state = pipe.state_dict()
    assert state["rule"] == "bucketing>krum" and [s["rule"] for s in state["stages"]] == ["bucketing", "krum"]
    first = pipe(x)
    pipe.load_state_dict(state)
    assert torch.equal(pipe(x), first)  # same generator state: same buckets
    with pytest.raises(ra.ConfigError, match=r"^Pipeline: cannot load state of rule 'krum'\.$"):
        pipe.load_state_dict({"rule": "krum"})


# --- registry ---------------------------------------------------------------------------------------------
NAMES = {"mean": ra.Mean, "coordinate_median": ra.CoordinateWiseMedian, "trimmed_mean": ra.CoordinateWiseTrimmedMean,
         "meamed": ra.MeaMed, "krum": ra.Krum, "multi_krum": ra.MultiKrum, "bulyan": ra.Bulyan,
         "geometric_median": ra.GeometricMedian, "centered_clipping": ra.CenteredClipping,
         "mda": ra.MinimumDiameterAveraging, "nnm": ra.NNM, "bucketing": ra.Bucketing, "clipping": ra.Clipping,
         "arc": ra.ARC,
         # similarity-based rules (part 2)
         "signguard": ra.SignGuard, "clipped_clustering": ra.ClippedClustering, "flame": ra.FLAME,
         "fltrust": ra.FLTrust, "foolsgold": ra.FoolsGold}


def test_registry_names():
    assert set(ra.available()) >= set(NAMES) and ra.available() == sorted(ra.available())
    for name, cls in NAMES.items():
        assert ra.lookup(name) is cls and cls.name == name
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert isinstance(ra.get(name), cls)
        # without f: warned exactly for the rules and maps whose output or requirement depend on f
        assert len(seen) == (name not in ("mean", "bucketing", "clipping")) == cls.f_matters
    assert isinstance(ra.get("nnm>trimmed_mean", f=1), ra.Pipeline)
    assert ra.get("nnm>trimmed_mean", f=1).rule.f == 1 and ra.get("nnm>trimmed_mean", f=1).pre[0].f == 1


def test_unknown_name_lists_every_name():
    with pytest.raises(ra.ConfigError) as info:
        ra.get("median")
    for name in NAMES:
        assert name in str(info.value)


@pytest.mark.parametrize("name", sorted(NAMES))
def test_hydra_instantiable(name):
    from hydra.utils import instantiate

    cls = NAMES[name]
    obj = instantiate({"_target_": f"robustagg.{cls.__name__}"})
    assert type(obj) is cls
    if "f" in cls.__init__.__code__.co_varnames:
        assert instantiate({"_target_": f"robustagg.{cls.__name__}", "f": 1}).f == 1


# --- get() without f; NumPy input ---------------------------------------------------------------------------
def test_get_without_f_warns_and_names_the_fix():
    with pytest.warns(ra.AssumptionWarning, match=r"^robustagg\.get\('trimmed_mean'\) without f builds it for f=0 "
                                                  r"Byzantine workers: it tolerates none .*Pass the bound you assume, "
                                                  r"e\.g\. robustagg\.get\('trimmed_mean', f=1\)\.$"):
        rule = ra.get("trimmed_mean")
    assert rule.f == 0  # the default is unchanged: warned, not refused
    with pytest.warns(ra.AssumptionWarning, match=r"robustagg\.get\('bucketing>krum'\) without f"):
        ra.get("bucketing>krum")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # f given (0 too), the mean, an informational map: silent
        ra.get("trimmed_mean", f=0), ra.get("mean"), ra.get("bucketing"), ra.get("clipping"), ra.get("nnm>krum", f=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # Python's default: once per calling line
        for _ in range(3):
            ra.get("krum")
    assert len(seen) == 1 and "robustagg.get('krum')" in str(seen[0].message)
    assert seen[0].filename == __file__  # points at the caller's line, not the registry


def test_numpy_input_is_accepted_and_keeps_its_dtype():
    import numpy as np

    x = np.array([[1.0, 9.0], [2.0, 0.0], [4.0, 1.0], [100.0, 3.0], [5.0, 5.0]])
    # trimmed mean, f=1: column 0 sorted 1 2 4 5 100 -> (2+4+5)/3; column 1: 0 1 3 5 9 -> (1+3+5)/3 = 3
    want = torch.tensor([11.0 / 3.0, 3.0], dtype=torch.float64)
    rule = ra.CoordinateWiseTrimmedMean(f=1)
    for given in (x, list(x), x.astype(np.float32)):
        out = rule(given)
        assert isinstance(out, torch.Tensor)
        assert out.dtype == (torch.float32 if given is not x and not isinstance(given, list) else torch.float64)
        torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=0)
    frozen = x.copy()
    frozen.flags.writeable = False  # copied, not shared (torch warns on a read-only buffer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(rule(frozen), rule(torch.from_numpy(x)))
    assert torch.equal(ra.get("nnm>krum", f=1)(x), ra.get("nnm>krum", f=1)(torch.from_numpy(x)))
    assert torch.equal(rule.weights(x), rule.weights(torch.from_numpy(x)))
    assert torch.equal(rule(x.astype(">f8")), rule(x))  # byte-swapped: converted
    np.testing.assert_array_equal(x, np.array([[1.0, 9.0], [2.0, 0.0], [4.0, 1.0], [100.0, 3.0], [5.0, 5.0]]))
