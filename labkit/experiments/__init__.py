"""Experiments: each is a plain function that drives the engine and returns an evidence record."""
