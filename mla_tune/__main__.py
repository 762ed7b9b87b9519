"""`python -m mla_tune ...` runs the CLI (for machines where the console script is not installed).

`main` is also the `mla-tune` console script: it imports the CLI inside a handler, so a
Ctrl-C while Python is still importing (typer, torch) exits 130 without a traceback.
"""

import sys


def main() -> None:
    try:
        from mla_tune.cli import app

        app(prog_name="mla-tune")
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)


if __name__ == "__main__":
    main()
