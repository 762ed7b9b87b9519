"""mla-tune: offline autotuning of MLA decode attention into a frozen dispatch table."""

__version__ = "0.1.0"
