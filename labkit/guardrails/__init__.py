"""Numerical guardrails (handbook 5.2.5, B.5, B.8.1, B.1.6): teacher-forced logits, collected and compared.

``suites`` holds the fixed trajectories and checkpoint ids, ``forcing`` drives the engine with preset
next ids (and the KV probe), ``collect`` writes a collection (engine or transformers), ``compare`` judges
two collections row by row, ``calibrate`` holds the one-command guard and the threshold calibration, and
``cached_forward`` the cached-vs-uncached transformers experiment. Plain functions; the Typer shells live
in the CLI package.
"""
