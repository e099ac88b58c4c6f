"""``esi-sidecar simulate``: how save policies fare against moving release deadlines.

``engine`` (the discrete-event loop), ``policies`` (the real guard, verl's rule, periodic
saving), ``workloads`` (deadline schedules), ``table`` (the table, CSV, plot and top-up
target), ``command`` (the CLI command). Standard library only, except matplotlib for the
plot. docs/simulation.md is written by the repository's ``tools/simulation_report.py``,
which is not shipped.
"""
