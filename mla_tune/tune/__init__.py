"""Tuning: configs, the sweep and its search, workers, the results file, timing, and
`mla-tune time variants` (time_variants.py: chosen variants checked and timed side by side)."""
