"""Command options derived from a declaration (the server's settings), built the first time click
asks a command for its parameters (to parse its arguments or print its help).

Deriving them imports the declaration, i.e. pydantic, which took ``import modelkiln.cli`` from
about 0.2 to 0.4-0.6 s on this 2-core box. Built lazily, only the command that uses them pays:
``kiln --help`` and ``kiln convert`` never import pydantic (a test checks it)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Optional

import typer
from typer.core import TyperCommand

DERIVED = "modelkiln.derived_options"  # ctx.meta key: {parameter name: value} of the derived options


class DerivedOptionsCommand(TyperCommand):
    """A typer command plus the options ``derive()`` returns, inserted before ``insert_before``.
    Their values reach the command function as ``ctx.meta[DERIVED]`` (None = not given), since
    typer passes a function only the parameters of its own signature."""

    insert_before = "config"
    _derived: Optional[list[Any]] = None  # typer's click parameters (typer may vendor click)

    def derive(self) -> list[Any]:
        raise NotImplementedError

    def get_params(self, ctx: Any) -> list[Any]:
        if self._derived is None:
            self._derived = self.derive()
            names = [p.name for p in self.params]
            at = names.index(self.insert_before) if self.insert_before in names else len(names)
            self.params[at:at] = self._derived
        return super().get_params(ctx)

    def invoke(self, ctx: Any) -> Any:
        names = {p.name for p in self._derived or ()}
        ctx.meta[DERIVED] = {name: ctx.params.pop(name) for name in list(ctx.params) if name in names}
        return super().invoke(ctx)


def typer_params(parameters: Sequence[inspect.Parameter]) -> list[Any]:
    """Click parameters made by typer itself (public ``typer.main.get_command``) from function
    parameters whose defaults are ``typer.Option(...)``: the same types, flags and help format
    as every hand-written option."""

    def carrier(**values: Any) -> None:  # never called: it only carries the signature
        raise AssertionError("not a command")

    carrier.__signature__ = inspect.Signature(list(parameters))  # type: ignore[attr-defined]  # read by inspect.signature
    carrier.__annotations__ = {p.name: p.annotation for p in parameters}
    holder = typer.Typer(add_completion=False)
    holder.command()(carrier)
    return list(typer.main.get_command(holder).params)


def keyword(name: str, annotation: Any, option: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=option)
