"""Hydra applications: train, report, bench, bench_distributed (wires robustagg, attacks and data)."""
