"""`python -m mla_tune ...` runs the CLI (for machines where the console script is not installed)."""

from mla_tune.cli import app

app(prog_name="mla-tune")
