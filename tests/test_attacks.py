"""Attack zoo: API, registry, reference cases, generic properties, degenerate inputs, errors."""

from __future__ import annotations

import json
import math
import os
import pathlib
import re

import pytest
import torch

import attacks
import robustagg as ra
from attacks import Kind, Knowledge
from robustagg.errors import AssumptionError, ConfigError, NonFiniteInputError, ShapeError

os.environ.setdefault("WANDB_MODE", "disabled")
torch.set_num_threads(1)

DATA = pathlib.Path(__file__).parent / "data" / "attacks.json"
CASES = json.loads(DATA.read_text())

ALL = ["agr_tailored", "alie", "backdoor", "backdoor_dba", "bit_flip", "constant", "fang_krum", "fang_trimmed_mean",
       "gaussian", "ipm", "label_flip", "large_norm", "mimic", "min_max", "min_sum", "model_replacement", "mpaf",
       "opt_alie", "opt_ipm", "poisoned_fl", "sign_flip", "zero"]

#: Non-default parameters exercised for every attack (the defaults are exercised too).
PARAMS: dict[str, list[dict]] = {
    "agr_tailored": [{}, {"direction": "unit"}, {"direction": "sign", "grid": 8, "refine": 4}],
    "alie": [{}, {"z": 1.5}, {"source": "own"}],
    "bit_flip": [{}, {"scale": 3.0}],
    "constant": [{}, {"c": -2.5}],
    "fang_krum": [{}, {"reference": "mean"}],
    "fang_trimmed_mean": [{}, {"reference": "mean", "b": 3.0}],
    "gaussian": [{}, {"mu": 1.0, "sigma": 0.5}],
    "ipm": [{}, {"epsilon": 2.0}],
    "label_flip": [{}],
    "large_norm": [{}],
    "mimic": [{}, {"warmup": 3}],
    "min_max": [{}, {"direction": "unit"}, {"direction": "sign"}],
    "min_sum": [{}, {"direction": "unit"}, {"direction": "sign"}],
    "sign_flip": [{}],
    "zero": [{}],
    "opt_alie": [{}, {"z_max": 3.0, "grid": 6, "refine": 2}],
    "opt_ipm": [{}, {"epsilon_max": 5.0, "grid": 6, "refine": 2}],
    "backdoor": [{}, {"target": 3, "fraction": 1.0, "size": 2, "margin": 1, "value": 0.5}],
    "backdoor_dba": [{}, {"parts": 2, "size": 2}],
    "model_replacement": [{}, {"boost": 3.0}],
    "mpaf": [{}, {"scale": 2.0, "base_std": 0.0, "seed": 3}],
    "poisoned_fl": [{}, {"scale": 0.5, "lr": 0.05, "period": 2, "decay": 0.5, "threshold": 0.9}],
}
CONFIGS = [(name, p) for name in ALL for p in PARAMS[name]]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in p.items()) or 'default'}" for n, p in CONFIGS]


def call(attack: attacks.Attack, honest: torch.Tensor, f: int, seed: int = 0, rule=None) -> torch.Tensor:
    """Call with what the knowledge model needs: own rows derived from the honest ones, a Mean rule."""
    own = None
    if attack.knowledge is Knowledge.OWN:
        g = torch.Generator().manual_seed(seed + 1)
        own = (honest[:1].expand(f, -1) + torch.randn(f, honest.shape[1], generator=g, dtype=torch.float64)
               .to(honest.dtype))
    if attack.knowledge is Knowledge.HONEST_RULE and rule is None:
        rule = ra.Mean()
    w = None
    if attack.needs_parameters:  # a model state derived from the honest rows' shape and seed
        w = torch.randn(honest.shape[1], generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64)
    return attack(honest, f, own=own, rule=rule, generator=torch.Generator().manual_seed(seed), parameters=w)


def honest_rows(h: int = 6, d: int = 5, dtype=torch.float64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(h, d, generator=g, dtype=torch.float64) + 1.0).to(dtype)


# --- registry and API ----------------------------------------------------------------------------

def test_available_lists_the_zoo_sorted():
    assert attacks.available() == ALL  # ALL is sorted by hand


@pytest.mark.parametrize("name", ALL)
def test_class_attributes_and_hydra_target(name):
    from hydra.utils import instantiate

    a = attacks.get(name)
    cls = type(a)
    assert getattr(attacks, cls.__name__) is cls
    assert cls.name == name and isinstance(a.knowledge, Knowledge) and isinstance(cls.kind, Kind)
    assert cls.__doc__ and "References" in cls.__doc__ and "Knowledge" in cls.__doc__ and ">>>" in cls.__doc__
    built = instantiate({"_target_": f"attacks.{cls.__name__}", **PARAMS[name][-1]})
    assert type(built) is cls
    assert repr(built).startswith(cls.__name__ + "(")


def test_knowledge_and_kind_declarations():
    k = {n: attacks.get(n).knowledge for n in ALL}
    assert k["agr_tailored"] is Knowledge.HONEST_RULE
    assert {n for n, v in k.items() if v is Knowledge.NONE} == {"constant", "gaussian", "large_norm", "zero", "mpaf",
                                                                "poisoned_fl"}
    assert {n for n, v in k.items() if v is Knowledge.OWN} == {"bit_flip", "label_flip", "backdoor", "backdoor_dba",
                                                               "model_replacement"}
    assert {n for n, v in k.items() if v is Knowledge.HONEST_RULE} == {"agr_tailored", "opt_alie", "opt_ipm"}
    assert attacks.ALIE(source="own").knowledge is Knowledge.OWN
    assert Knowledge.HONEST_RULE.value == "honest+rule"
    assert [n for n in ALL if attacks.get(n).kind is Kind.DATA] == ["backdoor", "backdoor_dba", "label_flip",
                                                                     "model_replacement"]
    assert [n for n in ALL if attacks.get(n).needs_parameters] == ["mpaf", "poisoned_fl"]
    assert [n for n in ALL if attacks.get(n).stateful] == ["mimic", "mpaf", "poisoned_fl"]


def test_get_refuses_unknown_names_and_params():
    with pytest.raises(ConfigError, match=r"unknown attack 'nope'; available: agr_tailored, alie, .*zero\."):
        attacks.get("nope")
    with pytest.raises(ConfigError, match=r"^unknown attack 'alei' \(did you mean alie\?\); available: agr_tailored"):
        attacks.get("alei")
    with pytest.raises(ConfigError, match=r"attack 'alie' \(ALIE\) does not take 'zz'; its parameters: z, source"):
        attacks.get("alie", zz=1.0)
    with pytest.raises(ConfigError, match=r"does not take 'scale'; its parameters: \(none\)"):
        attacks.get("sign_flip", scale=2.0)
    with pytest.raises(ConfigError, match=r"epsilon must be > 0"):
        attacks.get("ipm", epsilon=0.0)


def test_registry_refuses_duplicates():
    with pytest.raises(ConfigError, match=r"already has 'alie' \(ALIE\)"):
        attacks.register("alie")(type("Other", (attacks.Zero,), {}))
    assert attacks.lookup("alie") is attacks.ALIE


@pytest.mark.parametrize("ctor, pattern", [
    (lambda: attacks.IPM(epsilon=float("nan")), r"IPM: epsilon must be a finite number"),
    (lambda: attacks.Gaussian(sigma=-1.0), r"sigma must be >= 0"),
    (lambda: attacks.Constant(c=float("inf")), r"c must be a finite number"),
    (lambda: attacks.BitFlip(scale=0), r"scale must be > 0"),
    (lambda: attacks.ALIE(source="server"), r"source must be one of 'honest', 'own'; got 'server'"),
    (lambda: attacks.ALIE(z=True), r"z must be a finite number"),
    (lambda: attacks.MinMax(direction="up"), r"direction must be one of 'unit', 'std', 'sign'"),
    (lambda: attacks.MinSum(direction=None), r"direction must be one of"),
    (lambda: attacks.AGRTailored(grid=0), r"grid must be an integer >= 1"),
    (lambda: attacks.AGRTailored(refine=-1), r"refine must be an integer >= 0"),
    (lambda: attacks.AGRTailored(lambda_max=-1.0), r"lambda_max must be > 0"),
    (lambda: attacks.FangKrum(f=-1), r"f must be None \(use num_byzantine\) or an integer >= 0"),
    (lambda: attacks.FangKrum(reference="median"), r"reference must be one of 'krum', 'mean'"),
    (lambda: attacks.FangTrimmedMean(b=0.5), r"b must be >= 1"),
    (lambda: attacks.Mimic(warmup=0), r"warmup must be an integer >= 1"),
])
def test_constructor_validation(ctor, pattern):
    with pytest.raises(ConfigError, match=pattern):
        ctor()


# --- the shared reference cases ------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES["cases"], ids=[c["attack"] for c in CASES["cases"]])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_reference_cases(case, dtype):
    honest = torch.tensor(CASES["honest"], dtype=dtype)
    f = CASES["f"]
    assert honest.shape[0] + f == CASES["n"]
    a = attacks.get(case["attack"], **case["params"])
    out = a(honest, f)
    assert out.shape == (f, 3) and out.dtype == dtype
    assert torch.equal(out[0], out[1])  # all Byzantine rows equal
    tol = 1e-9 if dtype == torch.float64 else 1e-6
    if "expected" in case:
        assert torch.allclose(out[0].double(), torch.tensor(case["expected"], dtype=torch.float64), rtol=tol, atol=tol)
    if "z" in case:
        assert a.last_z == pytest.approx(case["z"], abs=1e-9)
        assert attacks.alie_z(CASES["n"], f) == pytest.approx(case["z"], abs=1e-9)
    if "gamma" in case:
        assert a.last_gamma == pytest.approx(case["gamma"], abs=case["tolerance"])
        # the row is mean + gamma * p with p = -mean/||mean|| (mean (2, 2, -1), norm 3)
        mu = torch.tensor([2.0, 2.0, -1.0], dtype=torch.float64)
        assert torch.allclose(out[0].double(), mu * (1 - case["gamma"] / 3.0), atol=1e-4)


def test_alie_z_hand_values():
    # n = 7, f = 2: s = floor(4.5) - 2 = 2, z = Phi^-1(5/7) = 0.5659488...; n = 10, f = 1: s = 5, z = Phi^-1(0.5) = 0
    assert attacks.alie_z(7, 2) == pytest.approx(0.5659488219, abs=1e-9)
    assert attacks.alie_z(10, 1) == pytest.approx(0.0, abs=1e-12)
    # n = 25, f = 5: s = floor(13.5) - 5 = 8, z = Phi^-1(17/25) = 0.4676988...
    assert attacks.alie_z(25, 5) == pytest.approx(0.46769879, abs=1e-7)


# --- generic properties: shape, dtype, finiteness, determinism, no mutation ------------------------

@pytest.mark.parametrize("name, params", CONFIGS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shape_dtype_finite_deterministic(name, params, dtype):
    honest = honest_rows(7, 6, dtype)
    before = honest.clone()
    outs = [call(attacks.get(name, **params), honest, 3, seed=5) for _ in range(2)]
    for out in outs:
        assert out.shape == (3, 6) and out.dtype == dtype and out.device == honest.device
        assert bool(torch.isfinite(out).all())
        assert out.data_ptr() != honest.data_ptr()
    assert torch.equal(outs[0], outs[1])  # same inputs and generator seed -> same bits
    assert torch.equal(honest, before)  # never mutated


@pytest.mark.parametrize("name", ALL)
def test_zero_byzantine_gives_empty_rows(name):
    honest = honest_rows(4, 3, torch.float32)
    out = call(attacks.get(name), honest, 0)
    assert out.shape == (0, 3) and out.dtype == torch.float32


@pytest.mark.parametrize("name", ["gaussian", "fang_trimmed_mean", "mimic"])
def test_randomised_attacks_follow_the_generator(name):
    honest = honest_rows(6, 8)
    a = call(attacks.get(name), honest, 2, seed=1)
    b = call(attacks.get(name), honest, 2, seed=2)
    if name == "mimic":  # only the start of the power iteration is random: the target may coincide
        assert torch.isfinite(a).all() and torch.isfinite(b).all()
    else:
        assert not torch.equal(a, b)


DEGENERATE = {
    "zero variance": torch.tensor([[1.0, -2.0, 3.0]] * 5),
    "one honest row": torch.tensor([[1.0, -2.0, 3.0]]),
    "zero mean": torch.tensor([[1.0, -1.0, 2.0], [-1.0, 1.0, -2.0], [0.0, 0.0, 0.0]]),
    "all zero": torch.zeros(4, 3),
    "huge (squares overflow float32)": torch.tensor([[1e30, -1e30, 3e38], [-2e30, 1e30, 3e38], [0.0, 5e29, 3e38]]),
    "tiny": torch.tensor([[1e-30, -1e-30, 0.0], [2e-30, 0.0, 1e-30]]),
}


@pytest.mark.parametrize("name, params", CONFIGS, ids=IDS)
@pytest.mark.parametrize("case", list(DEGENERATE), ids=list(DEGENERATE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_degenerate_inputs_stay_finite(name, params, case, dtype):
    honest = DEGENERATE[case].to(dtype)
    for f in (1, 2):
        if name == "alie" and "z" not in params and math.floor((honest.shape[0] + f) / 2 + 1) - f <= 0:
            with pytest.raises(ConfigError, match=r"z is undefined"):  # h = 1, f = 2: s = 0
                call(attacks.get(name, **params), honest, f)
            continue
        out = call(attacks.get(name, **params), honest, f)
        assert out.shape == (f, 3) and out.dtype == dtype
        assert bool(torch.isfinite(out).all()), (name, case, out)


def test_degenerate_values_by_hand():
    zv = DEGENERATE["zero variance"].double()
    row = zv[0]
    # zero spread: ALIE, MinMax and MinSum return the mean itself (sigma = 0, R = 0)
    for a in (attacks.ALIE(), attacks.MinMax(), attacks.MinSum(), attacks.MinMax(direction="unit")):
        assert torch.equal(a(zv, 2), row.expand(2, 3)), a
    # zero mean: unit and sign directions vanish, gamma = 0, output = the (zero) mean
    zm = DEGENERATE["zero mean"].double()
    a = attacks.MinMax(direction="unit")
    assert torch.equal(a(zm, 1), torch.zeros(1, 3, dtype=torch.float64)) and a.last_gamma == 0.0
    # one honest row: std = 0 (not NaN) so ALIE returns that row
    one = DEGENERATE["one honest row"].double()
    assert torch.equal(attacks.ALIE(z=2.0)(one, 1), one)


def test_large_norm_saturates_to_the_dtype_range():
    out = attacks.LargeNorm()(torch.zeros(2, 3, dtype=torch.float16), 1)
    assert out.dtype == torch.float16 and bool((out == 65504).all())
    out = attacks.Constant(c=-1e300)(torch.zeros(2, 3), 2)
    assert bool((out == -torch.finfo(torch.float32).max).all())
    assert torch.equal(attacks.LargeNorm()(torch.zeros(1, 2, dtype=torch.float64), 1),
                       torch.full((1, 2), 1e6, dtype=torch.float64))


# --- input validation and knowledge requirements -------------------------------------------------

def test_missing_knowledge_is_refused_with_the_argument_named():
    honest = honest_rows(5, 3)
    with pytest.raises(ConfigError, match=r"BitFlip uses the Byzantine workers' own gradients: pass own= "
                                          r"\(a \(2, 3\) tensor"):
        attacks.BitFlip()(honest, 2)
    with pytest.raises(ConfigError, match=r"ALIE uses the Byzantine workers' own gradients: pass own="):
        attacks.ALIE(source="own")(honest, 2)
    with pytest.raises(ConfigError, match=r"LabelFlip uses .* pass own="):
        attacks.LabelFlip()(honest, 1)
    with pytest.raises(ConfigError, match=r"AGRTailored is rule-aware: pass rule= \(the defender's aggregator"):
        attacks.AGRTailored()(honest, 2)
    with pytest.raises(ConfigError, match=r"rule must be a callable aggregator"):
        attacks.AGRTailored()(honest, 2, rule="krum")


def test_alie_refuses_s_not_positive():
    # h = 2, f = 3: n = 5, s = floor(3.5) - 3 = 0
    with pytest.raises(ConfigError, match=re.escape("s = floor(n/2 + 1) - f = 0 <= 0") + r".*Pass an explicit z"):
        attacks.ALIE()(honest_rows(2, 3), 3)
    with pytest.raises(ConfigError, match=r"n=4, f=4: s = floor\(n/2 \+ 1\) - f = -1"):
        attacks.alie_z(4, 4)
    assert torch.isfinite(attacks.ALIE(z=1.0)(honest_rows(2, 3), 3)).all()  # explicit z: no s needed


@pytest.mark.parametrize("bad, err, pattern", [
    (torch.ones(3), ShapeError, r"honest must be a 2-D tensor of shape \(n, d\)"),
    (torch.ones(3, 2, dtype=torch.int64), ShapeError, r"honest must have a floating dtype"),
    (torch.ones(0, 2), ShapeError, r"honest must have at least one row"),
    (torch.tensor([[1.0, 2.0], [float("nan"), 0.0]]), NonFiniteInputError, r"honest has non-finite .* rows \[1\]"),
])
def test_bad_honest(bad, err, pattern):
    with pytest.raises(err, match=pattern):
        attacks.SignFlip()(bad, 1)


def test_bad_own_num_byzantine_and_generator():
    honest = honest_rows(4, 3)
    with pytest.raises(ShapeError, match=r"own must have shape \(num_byzantine, d\) = \(2, 3\); got \(2, 4\)"):
        attacks.BitFlip()(honest, 2, own=torch.ones(2, 4, dtype=torch.float64))
    with pytest.raises(ShapeError, match=r"own must have the dtype and device of honest"):
        attacks.BitFlip()(honest, 2, own=torch.ones(2, 3))
    with pytest.raises(NonFiniteInputError, match=r"own has non-finite .* rows \[0\]"):
        attacks.BitFlip()(honest, 2, own=torch.tensor([[math.inf, 0, 0], [0, 0, 0]], dtype=torch.float64))
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match=r"num_byzantine must be a non-negative integer"):
            attacks.Zero()(honest, bad)
    with pytest.raises(ConfigError, match=r"generator must be a torch.Generator or None"):
        attacks.Gaussian()(honest, 1, generator=0)


def test_rule_refusal_propagates_from_agr_tailored():
    honest = honest_rows(3, 2)
    with pytest.raises(AssumptionError, match=r"n >= 2f \+ 1"):
        attacks.AGRTailored()(honest, 3, rule=ra.CoordinateWiseTrimmedMean(f=3))


def test_stateless_state_dict_roundtrip_and_foreign_state():
    a = attacks.ALIE()
    assert a.state_dict() == {"attack": "alie"}
    a.load_state_dict({"attack": "alie"})
    a.reset()
    with pytest.raises(ConfigError, match=r"ALIE: cannot load the state of attack 'ipm'"):
        a.load_state_dict({"attack": "ipm"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_std64_is_torchs_float64_std_bit_for_bit(dtype):
    """ALIE's (and the std direction's) sigma: the row-at-a-time Welford path gives torch's bits."""
    from attacks._stats import std64

    g = torch.Generator().manual_seed(19)
    shapes = [(2, 2), (2, 5000), (3, 7), (8, 4810), (17, 300), (80, 97), (200, 33), (2, 1), (96, 1)]
    for h, d in shapes:
        scale = torch.exp(torch.randn(d, generator=g, dtype=torch.float64) * 6)  # 1e-8 .. 1e8 per column
        for x in (torch.randn(h, d, generator=g, dtype=torch.float64) * scale,  # spread
                  torch.randint(-2, 3, (h, d), generator=g).double(),  # exact ties, zero columns
                  1.0 + 1e-9 * torch.randn(h, d, generator=g, dtype=torch.float64)):  # near-constant
            x = x.to(dtype)
            want = x.to(torch.float64).std(dim=0, correction=1)
            got = std64(x)
            assert got.dtype == torch.float64 and got.shape == (d,)
            assert torch.equal(got, want), (h, d)
    assert torch.equal(std64(torch.ones(1, 3)), torch.zeros(3, dtype=torch.float64))  # one row: 0
    t = torch.randn(50, 9, generator=g, dtype=torch.float64).T  # a strided view: (9, 50)
    assert torch.equal(std64(t), t.std(dim=0, correction=1))
