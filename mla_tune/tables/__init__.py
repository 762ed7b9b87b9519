"""Tables and lookup: the table format, dispatch, diff, rendering and reports."""
