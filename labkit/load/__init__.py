"""Load: fixed arrival traces, their replay against the service, the report over the event logs.

``trace`` writes a trace (``labkit trace``), ``replay`` runs it in process or over HTTP (``labkit
load``), ``report`` turns event logs into latency and throughput (``labkit report``), and ``simulate``
drives the whole chain on CPU through the lifecycle cases of handbook 5.7.1 (``labkit simulate``).
"""
