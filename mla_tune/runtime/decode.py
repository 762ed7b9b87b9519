"""The old import path of the serving call, kept for existing imports: the call lives in
mla_tune/serving/call.py (`Decoder`, `decode`). New code imports from there."""

from mla_tune.serving.call import Decoder, clear_decoders, decode, infer_spec  # noqa: F401
