"""Job events: what the jobs on this node say (``POST``/``GET /v1/events``, docs/events.md)."""
