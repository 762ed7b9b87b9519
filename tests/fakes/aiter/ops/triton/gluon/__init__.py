"""Fake aiter.ops.triton.gluon (the package; mla_gluon exists from 0.1.18)."""
