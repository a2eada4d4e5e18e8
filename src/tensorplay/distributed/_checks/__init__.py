"""Checks every front end runs: argument validation, plan agreement across ranks, all-or-nothing load checks."""
