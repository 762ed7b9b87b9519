"""The old import path of `DecodePlan`, kept for existing imports: the plan lives in
mla_tune/serving/decode_plan.py. New code imports from there."""

from mla_tune.serving.decode_plan import DecodePlan  # noqa: F401
