"""docs/results.md quotes only committed result files: every generated block equals what
experiments.results_page renders from docs/results/, and the renderers are checked on hand-made
files (the worst case over attacks, the cost line)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from experiments import results_page as rp
from experiments.report_worstcase import worst_case


def test_every_generated_block_of_the_pages_is_what_the_committed_files_give():
    for page in rp.PAGES:
        text = page.read_text(encoding="utf-8")
        found = rp.blocks(text)
        assert found, f"{page.name} has no generated block"
        for name, body in found.items():
            assert body == rp.render_block(name), f"{page.name}: block {name} is stale: run " \
                                                  "python -m experiments.results_page render"
        assert rp.render_page(text) == text


def _results() -> pd.DataFrame:
    rows = []
    for seed, (none, alie, ipm) in enumerate([(0.80, 0.50, 0.70), (0.82, 0.54, 0.40)]):
        for attack, acc in (("none", none), ("alie", alie), ("ipm", ipm)):
            rows.append({"rule": "krum", "setting": "iid", "attack": attack, "seed": seed, "final_acc": acc,
                         "status": "ok"})
    rows.append({"rule": "bulyan", "setting": "iid", "attack": "alie", "seed": 0, "final_acc": float("nan"),
                 "status": "skipped"})
    return pd.DataFrame(rows)


def test_worst_case_takes_the_lowest_seed_mean_over_attacks():
    t = worst_case(_results())
    assert list(t["rule"]) == ["krum"]  # bulyan's only run was skipped: no accuracy
    row = t.iloc[0]
    # alie: mean(0.50, 0.54) = 52 %, ipm: mean(0.70, 0.40) = 55 %: alie is the worst on average.
    assert row["worst_attack"] == "alie" and abs(row["worst_acc"] - 52.0) < 1e-9 and abs(row["worst_std"] - 2.0) < 1e-9
    assert abs(row["no_attack_acc"] - 81.0) < 1e-9 and abs(row["no_attack_std"] - 1.0) < 1e-9
    assert row["attacks"] == 2 and row["seeds"] == 2


def test_renderers_on_hand_made_files(tmp_path):
    folder = tmp_path / "fmnist_benchmark"
    folder.mkdir()
    worst_case(_results()).to_csv(folder / "worst_case.csv", index=False)
    (folder / "cost.json").write_text(json.dumps({"runs": 7, "status": {"ok": 6, "skipped": 1}, "timed_jobs": 7,
                                                  "cpu_seconds": 7200.0, "wall_seconds": 9000.0}))
    table = rp.render_block("fmnist_worst_case", results=tmp_path)
    assert "| krum | 81.0 ± 1.0 | 52.0 ± 2.0 (alie, 2 attacks) |" in table
    cost = rp.render_block("fmnist_cost", results=tmp_path)
    assert cost.startswith("7 runs (6 ok, 1 skipped); 7 timed jobs took 2.00 CPU-hours (2.50 hours")


def test_the_byzfl_sentence_matches_its_table():
    """The page says all six rules agree with ByzFL within the seeds' spread: the table must say so."""
    text = rp.PAGE.read_text(encoding="utf-8")
    assert "All six rules agree" in text
    body = rp.render_block("byzfl_accuracy")
    rows = [ln for ln in body.splitlines()[2:] if ln.startswith("| ")]
    assert len(rows) == 6 and all("| yes |" in ln for ln in rows)


def test_collect_merges_shards_a_newer_run_of_a_cell_replaces_the_older(tmp_path):
    # two shards collected one after the other, as a benchmark too big for one session is: the
    # second adds seed 1 and runs one cell of seed 0 again; the run folders of the first are gone
    from test_report import make_run

    first, second, results = tmp_path / "2026-12-01_10-00-00", tmp_path / "2026-12-02_10-00-00", tmp_path / "res"
    make_run(first, 0, "mean", "none", "iid", 0, 0.90)
    make_run(first, 1, "krum", "alie", "iid", 0, 0.60)
    make_run(first, 2, "mean", "alie", "dirichlet", 0, 0.40)
    (first / "0" / "job_timing.json").write_text(json.dumps({"cpu_s": 10.0, "wall_s": 12.0}))
    rp.collect("bench", first, results=results)
    import shutil

    shutil.rmtree(first)
    make_run(second, 0, "krum", "alie", "iid", 0, 0.65)  # the same cell again: replaces 0.60
    make_run(second, 1, "mean", "none", "iid", 1, 0.92)
    (second / "1" / "job_timing.json").write_text(json.dumps({"cpu_s": 4.0, "wall_s": 5.0}))
    dest = rp.collect("bench", second, results=results)
    rows = pd.read_csv(dest / "results.csv")
    assert len(rows) == 4
    cells = {(r.rule, r.attack, r.setting, r.seed): (r.run_id, r.final_acc) for r in rows.itertuples()}
    assert cells[("krum", "alie", "iid", 0)] == ("2026-12-02_10-00-00/0", 0.65)
    assert cells[("mean", "none", "iid", 0)] == ("2026-12-01_10-00-00/0", 0.90)
    assert ("mean", "alie", "dirichlet(a=0.1)", 0) in cells and ("mean", "none", "iid", 1) in cells
    curves = pd.read_csv(dest / "curves.csv")
    assert "2026-12-01_10-00-00/1" not in set(curves["run_id"])  # the replaced run's curve went with it
    assert set(curves["run_id"]) == {rid for rid, _ in cells.values()}
    cost = json.loads((dest / "cost.json").read_text())
    assert [s["sweep"] for s in cost["shards"]] == ["2026-12-01_10-00-00", "2026-12-02_10-00-00"]
    assert (cost["runs"], cost["cpu_seconds"], cost["wall_seconds"], cost["timed_jobs"]) == (4, 14.0, 17.0, 2)
    assert (dest / "worst_case.csv").is_file() and (dest / "accuracy_heatmap.png").read_bytes()[:4] == b"\x89PNG"
    again = rp.collect("bench", second, results=results)  # collecting the same shard twice changes nothing
    assert len(pd.read_csv(again / "results.csv")) == 4
    assert json.loads((again / "cost.json").read_text())["cpu_seconds"] == 14.0


def test_rule_by_attack_averages_finished_seeds_by_hand(tmp_path):
    # krum/none: seeds 0.80 and 0.70 -> 75.0 ± 7.1 (sample std of 80, 70 = 7.07); krum/alie one seed
    # 0.30 -> 30.0 ± 0.0 (1); a diverged run is not averaged; median/alie has no finished run -> —
    folder = tmp_path / "repro"
    folder.mkdir()
    pd.DataFrame([
        {"rule": "krum", "attack": "none", "seed": 0, "status": "ok", "final_acc": 0.80},
        {"rule": "krum", "attack": "none", "seed": 1, "status": "ok", "final_acc": 0.70},
        {"rule": "krum", "attack": "alie", "seed": 0, "status": "ok", "final_acc": 0.30},
        {"rule": "krum", "attack": "alie", "seed": 1, "status": "diverged", "final_acc": 0.10},
        {"rule": "coordinate_median", "attack": "none", "seed": 0, "status": "ok", "final_acc": 0.5},
        {"rule": "coordinate_median", "attack": "alie", "seed": 0, "status": "skipped", "final_acc": float("nan")},
    ]).to_csv(folder / "results.csv", index=False)
    assert rp._rule_by_attack(folder).splitlines() == [
        "| rule | none | alie |", "|---|---:|---:|",
        "| coordinate_median | 50.0 ± 0.0 (1) | — |",
        "| krum | 75.0 ± 7.1 (2) | 30.0 ± 0.0 (1) |"]


def test_collect_from_a_missing_folder_says_so_without_a_traceback(tmp_path, capsys):
    assert rp.main(["collect", "bench", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the sweep folder") and "Traceback" not in err


def test_the_fltrust_verdict_sentences_match_their_committed_table():
    import pandas as pd

    t = pd.read_csv(Path(__file__).resolve().parents[1] / "docs" / "results" / "repro_fltrust2021_fmnist" /
                    "results.csv")
    acc = t[t["status"] == "ok"].groupby(["rule", "attack"])["final_acc"].mean() * 100
    asr = t[t["attack"] == "model_replacement"].groupby("rule")["final_asr"].mean() * 100
    fl = acc["fltrust"]
    assert round(fl["none"], 1) == 85.0 and (fl["none"] - fl).max() <= 0.5 + 1e-9  # "within half a point"
    assert round(acc[("krum", "none")]) == 78 and round(acc[("krum", "fang_krum")]) == 51
    assert round(acc[("mean", "none")] - acc[("mean", "fang_trimmed_mean")]) == 13
    assert asr["fltrust"] > 99 and asr["mean"] > 99  # "about 100 %"
    assert max(asr[r] for r in ("coordinate_median", "trimmed_mean", "krum")) < 5
    drops = [acc[(r, "none")] - acc[(r, "label_flip")] for r in ("coordinate_median", "trimmed_mean")]
    assert 6 <= min(drops) and max(drops) <= 10 and round(acc[("mean", "none")] - acc[("mean", "label_flip")]) == 1


def test_the_replicated_reduction_cost_quoted_on_the_threat_model_is_the_committed_benchmark():
    root = Path(__file__).resolve().parents[1]
    t = pd.read_csv(root / "docs" / "results" / "bench_distributed_replicas.csv")
    r3 = t[t["mode"] == "reduction_r3"].set_index("rule")
    page = (root / "docs" / "threat-model.md").read_text()
    assert (r3["world"] == 8).all() and (r3["d"] == 10_000_000).all()
    assert f"{r3.loc['trimmed_mean', 'ratio_to_r1']:.2f}× (trimmed mean)" in page
    assert f"{r3.loc['coordinate_median', 'ratio_to_r1']:.2f}× (median)" in page
    assert f"{r3.loc['krum', 'ratio_to_r1']:.2f}× (Krum)" in page
    assert f"{r3.loc['geometric_median', 'ratio_to_r1']:.2f}× (geometric median" in page
    r1 = t[t["mode"] == "reduction_r1"].set_index("rule")
    assert f"sends {r3['sent_mb'].iloc[0]:.0f} MB per step at r_a = 3 against {r1['sent_mb'].iloc[0]:.0f} MB" in page
    for name in ("sequential", "shared"):  # the earlier runs the page quotes, each from its own file
        e = pd.read_csv(root / "docs" / "results" / f"bench_distributed_replicas_{name}.csv")
        e3 = e[e["mode"] == "reduction_r3"].set_index("rule")["ratio_to_r1"]
        assert f"{e3['trimmed_mean']:.2f}× / {e3['coordinate_median']:.2f}×" in page


def test_the_allouah_verdict_sentences_match_their_committed_table():
    t = pd.read_csv(Path(__file__).resolve().parents[1] / "docs" / "results" / "repro_allouah2023_fmnist" /
                    "results.csv")
    acc = t[t["status"] == "ok"].groupby(["rule", "setting", "attack"])["final_acc"].agg(["mean", "std"]) * 100
    gain = (acc.loc["nnm>trimmed_mean", "mean"] - acc.loc["trimmed_mean", "mean"]).round(1)
    assert len(gain) == 15 and int((gain > 0).sum()) == 12  # "12 of the 15 attack x alpha cells"
    assert gain[("dirichlet(a=0.1)", "ipm")] == 16.7 and gain[("dirichlet(a=0.1)", "label_flip")] == 14.4
    assert gain.idxmax() == ("dirichlet(a=0.1)", "ipm")
    assert sorted(gain[gain <= 0].index) == [("dirichlet(a=0.1)", "alie"), ("dirichlet(a=0.1)", "sign_flip"),
                                              ("dirichlet(a=0.5)", "alie")]
    assert (gain[("dirichlet(a=0.1)", "alie")], gain[("dirichlet(a=0.5)", "alie")],
            gain[("dirichlet(a=0.1)", "sign_flip")]) == (-1.2, -4.0, -3.2)
    collapsed = acc.loc[("nnm>trimmed_mean", "dirichlet(a=0.1)", "sign_flip")]
    assert (round(collapsed["mean"], 1), round(collapsed["std"], 1)) == (26.7, 27.0)
    assert len(t) == 270 and (t["status"] == "ok").all()  # "all 270 runs"
    means = acc["mean"]
    for base, cells in (("krum", 13), ("trimmed_mean", 12), ("geometric_median", 11)):
        g = (means.loc["nnm>" + base] - means.loc[base]).round(1)
        assert int((g > 0).sum()) == cells and g[("dirichlet(a=0.1)", "sign_flip")] < 0  # NNM hurts every rule there
    krum = (means.loc["nnm>krum"] - means.loc["krum"]).xs("dirichlet(a=0.1)")
    assert round(krum.mean(), 1) == 24.0
    assert (round(means[("krum", "dirichlet(a=0.1)", "label_flip")], 1),
            round(means[("nnm>krum", "dirichlet(a=0.1)", "label_flip")], 1)) == (31.7, 73.8)
    assert (round(means[("geometric_median", "dirichlet(a=0.1)", "ipm")], 1),
            round(means[("nnm>geometric_median", "dirichlet(a=0.1)", "ipm")], 1)) == (21.2, 69.9)
    for base, drop in (("krum", -10.1), ("geometric_median", -13.0)):
        assert round(means[("nnm>" + base, "dirichlet(a=0.1)", "sign_flip")] - means[(base, "dirichlet(a=0.1)",
                                                                                       "sign_flip")], 1) == drop
