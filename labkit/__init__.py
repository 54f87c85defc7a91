"""labkit: a checkpointed lab around the embedded ``engine``.

Commands live in the :mod:`labkit.cli` package; every evidence file is written by :mod:`labkit.evidence` and
judged by :mod:`labkit.checks` against the checkpoint definitions in ``checkpoints/``.
"""

from __future__ import annotations

__version__ = "0.1.0"
