"""``labkit bench``: offline throughput and latency on fixed workloads (``run``), paged decode attention
against the copy roof (``attention``), and where a bench run's time goes (``profile``)."""
