"""``esi-sidecar simulate``: how save policies fare against moving release deadlines.

``engine`` (the discrete-event loop), ``policies`` (the real guard, verl's rule, periodic
saving), ``workloads`` (deadline schedules), ``report`` (table, CSV, plot), ``command``
(the CLI command). Standard library only, except matplotlib for the plot.
"""
