"""Experiments: each is a plain function that drives the engine (or only its shapes) and returns an
evidence record: the smoke test, generation, the quick walk through the scheduler and the TP shapes."""
