"""The engine changes of the lab as patches (the top-level patches/ folder): ``store`` finds, applies and
reverts them with git's apply machinery and says which are applied (every evidence file records it).
The before/after runs of a pair are experiments (labkit/experiments/patch_check.py, patch_probes.py)."""
