"""What the benchmarks share (not a benchmark itself: ``make bench`` runs ``bench/*.py`` only)."""
