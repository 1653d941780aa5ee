"""Verdicts on a result: the gate, the sweep's and the cuts' recommendations and the regression test
against a baseline. Pure functions of a result's own numbers (they import only the core), so the
engine decides them and `render`, `compare` and `verify` recompute them from a file alone."""
