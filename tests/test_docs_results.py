"""Numbers the docs quote from a committed result file equal the file's (issue 28).

The quick sweep's tables in ``README.md`` and ``docs/experiments.md`` quote
``docs/results/integrity_vs_suppression_quick.csv`` (written by ``scripts/quick_sweep_results.py``);
every number is compared with the file, and one cell (the one that drifted) with a fresh run, so the
file follows the code.
"""

from __future__ import annotations

import csv
import math
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "integrity_vs_suppression_quick.csv"
#: (page, the text just before the table that quotes the file)
QUOTES = [("README.md", "The quick sweep's main table"), ("docs/experiments.md", "### Quick sweep (CI)")]


def _file() -> dict[tuple[str, str, str], str]:
    with RESULTS.open() as fh:
        return {(r["rule"], r["partition"], r["attack"]): r["final_acc"] for r in csv.DictReader(fh)}


def _table(page: str, anchor: str) -> dict[tuple[str, str, str], str]:
    """``{(rule, partition, attack): number as printed}`` of the first table after ``anchor``."""
    text = (ROOT / page).read_text().split(anchor, 1)[1]
    lines = []
    for line in text.splitlines():
        if line.startswith("|"):
            lines.append(line)
        elif lines:
            break
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    cols = [("iid" if h.lower().startswith("iid") else "dirichlet", h.replace(":", ",").split(",")[-1].strip().lower())
            for h in header[1:]]
    out = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rule = cells[0].replace(" ", "")
        for (partition, attack), value in zip(cols, cells[1:]):
            if value != "skipped":
                out[(rule, partition, attack)] = value
    return out


@pytest.mark.parametrize("page, anchor", QUOTES)
def test_every_number_of_the_quick_sweep_table_is_the_files(page, anchor):
    table, results = _table(page, anchor), _file()
    assert len(table) == 24
    wrong = {k: (v, results.get(k)) for k, v in table.items() if results.get(k) != v}
    assert not wrong, f"{page}: (printed, file) {wrong}; regenerate with scripts/quick_sweep_results.py"


#: The processor the committed file was made on (tests/platform_bits.py): the printed accuracy of a
#: cell can differ in its last digit on another one (the make-run pins of test_protocols differ too).
MADE_ON = ("GenuineIntel", "AVX512")


def test_the_file_is_what_the_code_prints_now(tmp_path):
    from platform_bits import platform

    if platform() != MADE_ON:
        pytest.skip(f"the committed quick-sweep file was made on {MADE_ON}, this is {platform()}: regenerate it "
                    "with scripts/quick_sweep_results.py on this processor to compare")
    spec = importlib.util.spec_from_file_location("quick_sweep_results", ROOT / "scripts" / "quick_sweep_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    row = module.cell("coordinate_median", "alie", "dirichlet", tmp_path / "run")
    assert row["final_acc"] == _file()[("coordinate_median", "dirichlet", "alie")]


def test_the_full_sweep_as_described_is_the_experiment_file():
    import re

    from omegaconf import OmegaConf

    params = OmegaConf.load(ROOT / "conf" / "experiment" / "integrity_vs_suppression.yaml").hydra.sweeper.params
    choices = {k: str(v).split(",") for k, v in params.items()}
    text = (ROOT / "docs" / "experiments.md").read_text().split("### What the full sweep runs", 1)[1]
    row = {line.split("|")[1].strip(): re.findall(r"`([a-z_0-9]+)`", line.split("|")[2])
           for line in text.split("\n\n", 2)[1].splitlines()[2:]}
    assert row["rules (`+experiment/rule=`)"] == choices["+experiment/rule"]
    assert row["attacks (`attack=`)"] == choices["attack"]
    sizes = [len(choices[k]) for k in ("+experiment/rule", "attack", "data.partition", "seed")]
    said = re.search(r"(\d+) × (\d+) × (\d+) × (\d+) = ([\d,]+) runs", text)
    assert [int(g) for g in said.groups()[:4]] == sizes and int(said.group(5).replace(",", "")) == math.prod(sizes)


def test_every_page_quotes_the_torch_pin_of_constraints_txt_and_how_to_get_the_cpu_build():
    import re

    (pin,) = re.findall(r"^torch==([\w.+]+)$", (ROOT / "constraints.txt").read_text(), flags=re.M)
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    quoting = {p: re.findall(r"torch==([\w.+]+)", p.read_text()) for p in pages}
    quoting = {p: v for p, v in quoting.items() if v}
    assert ROOT / "README.md" in quoting and ROOT / "docs" / "index.md" in quoting
    for page, versions in quoting.items():
        assert set(versions) == {pin}, f"{page.name} quotes torch=={versions}, constraints.txt pins {pin}"
        assert "download.pytorch.org/whl/cpu" in page.read_text(), f"{page.name}: the pin alone pulls the CUDA build"
