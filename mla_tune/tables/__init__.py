"""The leaderboard's tables and lookup: the table format, dispatch, diff and rendering."""
