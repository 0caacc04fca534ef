"""``fedge serve``: the coordinator as a long-running, supervised service (config, JSON logs,
``/metrics`` and ``/healthz``)."""
