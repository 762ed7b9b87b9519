"""Tuning: configs, the sweep and its search, workers, the results file, timing."""
