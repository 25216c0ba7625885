"""Stand-in package (see runner.py)."""
