"""The shared vocabulary every layer may use: errors, verdicts, formatting, JSON I/O, paths, limits, drill-down
section types, plugin entry points, acceptance statistics and key metrics."""
