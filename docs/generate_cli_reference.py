"""Write docs/reference/cli.md from the CLI itself: every command, its help and its options.

Run from the checkout: `python docs/generate_cli_reference.py` (or `make docs`). tests/unit/test_docs.py
fails when the committed file differs from what render() builds, so the reference cannot drift from the CLI.
The text comes from the click command tree typer builds, never from rich's rendering, so it does not depend
on the terminal's width.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "reference" / "cli.md"
# typer's own shell-completion options: their text depends on the shell mbtune runs under.
SKIPPED = {"install_completion", "show_completion"}


def render() -> str:
    """The CLI reference as markdown: the global options, then each command in name order."""
    import typer.main

    from mbtune.cli import app

    group: Any = typer.main.get_command(app)
    lines = [
        "# CLI reference",
        "",
        "<!-- Generated from the CLI by docs/generate_cli_reference.py; do not edit by hand. "
        "Regenerate with `make docs`. -->",
        "",
        _text(group.help),
        "",
        "Usage: `mbtune [GLOBAL OPTIONS] COMMAND [OPTIONS]`. Every command also takes `-h` / `--help`;",
        "`mbtune --install-completion` installs shell completion.",
        "",
        "## Global options",
        "",
        *_table(group.params),
    ]
    for name in sorted(group.commands):
        command = group.commands[name]
        if command.hidden:
            continue
        lines += ["", f"## mbtune {name}", "", _text(command.help), "", *_table(command.params)]
    return "\n".join(lines) + "\n"


def _table(params: list[Any]) -> list[str]:
    rows = [p for p in params if not getattr(p, "hidden", False) and p.name not in SKIPPED]
    if not rows:
        return ["No options."]
    table = ["| option | help | default |", "|---|---|---|"]
    for param in rows:
        table.append(f"| {_names(param)} | {_cell(getattr(param, 'help', None) or '')} | {_default(param)} |")
    return table


def _names(param: Any) -> str:
    if param.param_type_name == "argument":
        return f"`{(param.name or '').upper()}` (argument)"
    names = ", ".join(f"`{opt}`" for opt in param.opts)
    if param.secondary_opts:
        names += " / " + ", ".join(f"`{opt}`" for opt in param.secondary_opts)
    return names


def _default(param: Any) -> str:
    if param.required:
        text = "required"
    elif getattr(param, "is_flag", False) and param.secondary_opts:
        text = f"`{param.opts[0] if param.default else param.secondary_opts[0]}`"
    elif getattr(param, "is_flag", False) and not getattr(param, "count", False):
        text = "on" if param.default else "off"
    elif param.default is None or param.default == () or param.default == []:
        text = ""
    else:
        text = f"`{param.default}`"
    if param.envvar:
        envvars = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar)
        text += (" " if text else "") + "(env " + ", ".join(f"`{e}`" for e in envvars) + ")"
    return text


def _text(help_text: str | None) -> str:
    # `<` escaped: markdown would take profiles/<device>/... for an HTML tag and hide it.
    return inspect.cleandoc(help_text or "").strip().replace("<", "\\<")


def _cell(text: str) -> str:
    return " ".join(_text(text).split()).replace("|", "\\|")


def main() -> None:
    sys.path.insert(0, str(ROOT))  # the checkout's mbtune, also when it is not installed
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
