"""The ``labkit`` command line: thin Typer shells over plain functions.

``app`` holds the app, ``main`` and the setup commands; ``model`` the model commands, ``guardrails``
the ``logits`` and ``principles`` commands, ``service`` serve, client, trace, load, report and
simulate; ``options`` the option types they share. The console script is ``labkit.cli:main``.
"""
from __future__ import annotations

from labkit.cli import course, guardrails, model, notes, patch, pictures, principles, scheduler, service
from labkit.cli.app import app, main

app.add_typer(model.model_app, name="model")
service.register(app)
guardrails.register(app)
patch.register(app)
notes.register(app)
scheduler.register(app)
principles.register(app)
pictures.register(app)
course.register(app)

__all__ = ["app", "main"]
