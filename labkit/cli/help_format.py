"""How ``--help`` reads at 80 columns: option names are never cut and flags show no value hint.

Typer's rich help draws each panel as a rich Table whose columns all shrink when the terminal is narrow, so a
long option name became ``--max-num-batc…``; and it shows ``<bool>`` after every flag, which reads as if
``--trace true`` were accepted (it is not: a flag takes no value). :func:`install` makes the name columns keep
their widest cell (the type and help columns wrap instead) and shows no value type for a flag (``--trace`` is
a flag: ``--trace``/``--no-trace`` style, never ``--trace true``).
"""
from __future__ import annotations

import inspect
import re

import typer.rich_utils
from rich.table import Table
from rich.text import Text


class _HelpTable(Table):
    """A help panel's table. An options row (``[required,] long, short, negative long, negative short, type,
    help``) becomes ``[required,] names, type, help``: the names in one cell, a flag's negative form on a line of
    its own, no ``<bool>`` type for a flag. The names column keeps its widest line; the type column folds at 14 cells; the help text wraps."""

    def add_row(self, *renderables, **kwargs):
        if len(renderables) in (6, 7):
            head = renderables[:-6]
            long_, short, neg_long, neg_short, types, help_ = renderables[-6:]
            names = Text()
            for i, part in enumerate(p for p in (long_, short, neg_long, neg_short) if _text(p)):
                if i:
                    names.append("\n" if part in (neg_long, neg_short) else ", ")
                names.append(part if isinstance(part, Text) else Text(str(part)))
            if _text(types) == "<bool>":          # a typer bool option is a flag: it takes no value
                types = Text("")
            renderables = (*head, names, types, help_)
        return super().add_row(*renderables, **kwargs)

    def __rich_console__(self, console, options):
        columns = self.columns
        wrapping = 2 if len(columns) >= 3 and self._options_panel() else 1
        for column in columns[:-wrapping]:
            cells = list(column.cells)
            if cells:
                column.min_width = max(console.measure(c, options=options).maximum for c in cells)
                column.no_wrap = True
        if wrapping == 2:
            columns[-2].max_width, columns[-2].overflow = 14, "fold"
        yield from super().__rich_console__(console, options)

    def _options_panel(self) -> bool:
        return any(any(isinstance(c, Text) and c.plain.startswith("<") for c in col.cells) for col in self.columns)


def _text(part) -> str:
    return part.plain if isinstance(part, Text) else str(part or "")


_RST_LITERAL = re.compile(r"``([^`]+)``")
_LIST_LINE = re.compile(r"\s*([-*|]|\d+[.)])\s")


def plain_help_text(text: str) -> str:
    """A command's or option's help as the words it says. Our help strings are plain text (labkit.console's
    rule: no rich markup), so ``[len*(1-r), len*(1+r)]`` is an interval, not a markup tag to drop; ``x``
    (reStructuredText, from a docstring) reads `x`; a paragraph's line breaks (a docstring's source lines) are
    spaces, so rich wraps it at the terminal's width instead of at the source's."""
    text = _RST_LITERAL.sub(r"`\1`", inspect.cleandoc(text))
    paragraphs = []
    for para in text.split("\n\n"):
        lines = para.split("\n")
        if para.startswith("\b") or any(_LIST_LINE.match(ln) for ln in lines[1:]):
            paragraphs.append(para)             # click's "\b": keep this paragraph's lines as they are
        else:
            paragraphs.append(" ".join(ln.strip() for ln in lines))
    return "\n\n".join(paragraphs)


def _argument_name(param, usage: bool) -> str:
    """An argument's name, the same way everywhere: upper case (``PATH``, ``EVIDENCE``), optional in brackets
    on the usage line (``[TARGET]``), never ``{path}`` or a metavar bracketed twice (``[[MODEL]]``)."""
    name = str(param.display_name_raw).strip("[]{}<>").upper()
    if usage and not param.required:
        name = f"[{name}]"
    return name + ("..." if param.nargs != 1 else "")


def install() -> None:
    typer.rich_utils.Table = _HelpTable
    make_rich_text = getattr(typer.rich_utils, "_make_rich_text", None)
    if make_rich_text is not None:
        def _make_rich_text(*, text: str, style: str = "", markup_mode=None):
            if markup_mode != "rich":
                return make_rich_text(text=text, style=style, markup_mode=markup_mode)
            return Text(plain_help_text(text), style=style)

        typer.rich_utils._make_rich_text = _make_rich_text
    from typer.core import TyperArgument

    if hasattr(TyperArgument, "_usage_display_name"):         # typer >= 0.16's usage line and argument panel
        TyperArgument._usage_display_name = lambda self: _argument_name(self, usage=True)
    if hasattr(TyperArgument, "_rich_display_name"):
        TyperArgument._rich_display_name = lambda self: _argument_name(self, usage=False)
