"""Scoring a trained plan: `evaluate` / `predict` / `export` (one process or worker processes) and the
metrics (AUC)."""
