"""The engine changes of the lab as patches (the top-level patches/ folder): ``store`` finds, applies and
reverts them with git's apply machinery and says which are applied; ``check`` runs a before/after pair,
each side by ``probes`` in its own process on a copy of engine/, and judges it."""
