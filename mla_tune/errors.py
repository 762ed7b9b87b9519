"""The one base class of mla-tune's own errors.

Every error that means "your input, file or machine is not what mla-tune needs" derives from
MlaTuneError, with a one-line message naming the problem and the fix. The CLI prints those
as one red line; anything else is a bug in mla-tune and keeps its traceback. The errors
that were ValueErrors before this class existed (TableError, ConfigError, SweepError,
ResultsError, ExportError) derive from ValueError too, so existing `except ValueError`
clauses keep working.
"""

from __future__ import annotations


class MlaTuneError(Exception):
    """A problem with what mla-tune was given (a file, an option, the machine), not a bug."""
