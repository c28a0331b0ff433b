"""Benchmarks: figures, never pass/fail. ``make bench`` runs them all (``python -m bench``)."""
