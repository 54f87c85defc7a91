"""What the server tells: :mod:`.events` (event records and their JSONL log), :mod:`.metrics` (Prometheus text
for ``/metrics``), :mod:`.profiling` (torch.profiler around the owner's steps), :mod:`.logsafe` (log escaping)."""
