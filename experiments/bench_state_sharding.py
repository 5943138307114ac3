"""Sharded optimizer state measured: bit-identity and optimizer-state bytes per rank (issue 31).

``python -m experiments.bench_state_sharding`` (config ``conf/bench_state_sharding``) trains the
configured model (ResNet-20 with Adam by default) for ``steps`` steps at every world size of
``worlds``, twice from the same seed: ``trainer.state_sharding=none`` and ``=optimizer``
(``trainer.mode=processes``, ``trainer.reduction=sharded``, gloo, one worker per process). The
images are generated in the CIFAR-10 binary format (random pixels, ``images_per_worker`` per
worker, written to a temporary folder): the measurement is of the state and the arithmetic, not of
accuracy. Columns (:data:`COLUMNS`), one row per (world, mode):

- ``d``: parameters; ``coordinates``: rank 0's slice (``d`` unsharded);
- ``optimizer_state_bytes``: the optimizer state rank 0 holds after the run (the summary's
  ``state_sharding`` block); ``unsharded_bytes``: what the unsharded optimizer holds;
  ``fraction``: their ratio (about ``1 / world`` when sharded);
- ``model_sha256``: of the final ``model.safetensors``; ``identical``: equal to the unsharded
  run's of the same world size; ``run_seconds``: the run's wall time (the machine's load moves it).

Results go to ``state_sharding.csv`` in the Hydra run directory.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from .bench_train import compose

COLUMNS = ["world", "mode", "model", "optimizer", "steps", "d", "coordinates", "optimizer_state_bytes",
           "unsharded_bytes", "fraction", "identical", "model_sha256", "run_seconds"]


def write_cifar10(root: Path, n_train: int, n_test: int, seed: int) -> Path:
    """CIFAR-10 binary files (``cifar-10-batches-bin``: label byte + 3072 pixel bytes per record) of random images."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-bin"
    folder.mkdir(parents=True, exist_ok=True)

    def records(n: int) -> bytes:
        labels = rng.integers(0, 10, (n, 1), dtype=np.uint8)
        return np.concatenate([labels, rng.integers(0, 256, (n, 3072), dtype=np.uint8)], axis=1).tobytes()

    per = -(-n_train // 5)
    for i in range(1, 6):
        (folder / f"data_batch_{i}.bin").write_bytes(records(per))
    (folder / "test_batch.bin").write_bytes(records(n_test))
    return root


def _run(cfg: dict[str, Any], world: int, mode: str, root: Path, out: Path) -> dict[str, Any]:
    from experiments.train import train

    overrides = [f"model={cfg['model']}", f"optimizer={cfg['optimizer']}", f"aggregator={cfg['aggregator']}",
                 "attack=none", "data=cifar10", f"data.root={root}", "data.max_test_samples=16",
                 f"threat.n={world}", f"threat.f={cfg['f']}", "trainer.mode=processes", "trainer.reduction=sharded",
                 f"trainer.state_sharding={mode}", f"trainer.steps={cfg['steps']}",
                 f"trainer.batch_size={cfg['batch_size']}", "trainer.eval_every=0", "trainer.param_check_every=0",
                 "trainer.progress=false", "logger=none", f"seed={cfg['seed']}", "trainer.collective_timeout_s=300"]
    s = train(compose(overrides), out_dir=out, quiet=True)
    st = s["state_sharding"]
    return {"world": world, "mode": mode, "model": cfg["model"], "optimizer": cfg["optimizer"], "steps": int(s["steps"]),
            "d": int(s["num_parameters"]), "coordinates": int(st.get("coordinates", s["num_parameters"])),
            "optimizer_state_bytes": int(st["optimizer_state_bytes"]),
            "unsharded_bytes": int(st["optimizer_state_bytes_unsharded"]),
            "model_sha256": hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest(),
            "run_seconds": float(s["run_seconds"])}


def run_benchmark(cfg: dict[str, Any], work: Path) -> pd.DataFrame:
    """Both modes at every world size of ``cfg`` (keys as in ``conf/bench_state_sharding``); the result table."""
    rows = []
    for world in [int(w) for w in cfg["worlds"]]:
        root = write_cifar10(work / f"data-{world}", int(cfg["images_per_worker"]) * world, 16, int(cfg["seed"]))
        pair = [_run(cfg, world, mode, root, work / f"w{world}-{mode}") for mode in ("none", "optimizer")]
        for r in pair:
            r["fraction"] = r["optimizer_state_bytes"] / r["unsharded_bytes"] if r["unsharded_bytes"] else float("nan")
            r["identical"] = r["model_sha256"] == pair[0]["model_sha256"]
        rows.extend(pair)
    return pd.DataFrame(rows, columns=COLUMNS)


@hydra.main(config_path="../conf/bench_state_sharding", config_name="bench_state_sharding", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point: run, print and write ``state_sharding.csv`` in the run directory."""
    out_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    with tempfile.TemporaryDirectory(prefix="robustagg-state-sharding-") as tmp:
        table = run_benchmark(OmegaConf.to_container(cfg, resolve=True), Path(tmp))  # type: ignore[arg-type]
    print(table.drop(columns=["model_sha256"]).to_string(index=False))
    path = out_dir / "state_sharding.csv"
    with open(path.with_suffix(".csv.tmp"), "w") as fh:
        table.to_csv(fh, index=False)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(path.with_suffix(".csv.tmp"), path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
