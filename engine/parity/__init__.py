"""Parity of parallel layouts with one process: layouts, runs, comparison, the sweep (scripts/parity.py)."""
