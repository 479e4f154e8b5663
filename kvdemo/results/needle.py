"""Needle grids, as numbers: what the tables and figures of a `kvdemo.needle.run_grid` result read."""

from __future__ import annotations


def cell_key(row: dict) -> tuple[int, float, int]:
    """(length, depth, seed) of a row dict: the run it is, whatever its precision (reports written before
    repeats carry no seed: one seed per grid)."""
    return row["length"], row["depth"], row.get("seed", 0)
