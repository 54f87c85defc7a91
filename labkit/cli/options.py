"""Typer option types shared by the command modules (setup, model, guardrails, service)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

OutOpt = Annotated[
    Optional[Path],
    typer.Option("--out", "-o", dir_okay=False, help="Evidence file to write (default: the checkpoint's file under runs/)."),
]
ModelOpt = Annotated[
    Optional[Path],
    typer.Option("--model", help="Model directory (Hugging Face layout); default $MODEL_DIR, else a synthetic model."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout instead of tables.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto | cpu | cuda[:N].")]
AttentionOpt = Annotated[str, typer.Option("--attention", help="Attention backend: auto | flash_attn | triton | torch.")]
