"""`harness methods`: the methods, and each one's settings with their types, defaults and docs."""

from __future__ import annotations

import click
from rich.table import Table
from rich.text import Text

from harness.cli.common import console, print_text


@click.command("methods")
@click.argument("method", required=False)
@click.option("--markdown", is_flag=True, help="Print every method's settings as docs/methods.md holds them.")
def methods(method, markdown):
    """List the methods, or one method's settings (give them with --set KEY=VALUE or --set METHOD.KEY=VALUE)."""
    from harness.run.config import resolve_method
    from harness.run.settings import method_settings, settings_markdown
    from trainers.registry import method_class, method_names

    method = None if method is None else resolve_method(method)

    if markdown:
        click.echo(settings_markdown(method_names() if method is None else [method]), nl=False)
        return
    if method is None:
        table = Table(show_header=True, box=None, pad_edge=False)
        table.add_column("method", style="bold")
        table.add_column("what it is")
        for name in method_names():
            table.add_row(Text(name), Text(_first_sentence(_doc(method_class(name)))))
        console.print(table)
        print_text("a method's settings: harness methods METHOD")
        return
    if method not in method_names():
        raise click.UsageError(f"unknown method {method!r}; known methods: {', '.join(method_names())}")
    settings = method_settings(method)
    if not settings:
        print_text(f"{method} has no settings")
        return
    table = Table(show_header=True, box=None, pad_edge=False)
    for column in ("setting", "type", "default", "what it is"):
        table.add_column(column, style="bold" if column == "setting" else None)
    for setting in settings:
        table.add_row(*(Text(v) for v in setting))
    console.print(table)
    print_text(f"set one with: harness run --method {method} --set KEY=VALUE (sweeps: --set {method}.KEY=VALUE)")


def _doc(cls: type) -> str:
    """The method's own docstring, else its module's (where the method files describe the algorithm)."""
    import sys

    return cls.__doc__ or sys.modules[cls.__module__].__doc__ or ""


def _first_sentence(doc: str) -> str:
    text = " ".join(doc.split())
    return text.split(". ")[0].rstrip(".") if text else ""
