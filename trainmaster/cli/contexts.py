"""Which controller service a remote verb talks to, and with which token: named contexts.

As kubeconfig does for ``kubectl``, a context names a server and the token to show it, saved in
``contexts.yaml`` in the Trainmaster home (mode 600, in a 700 folder); ``trainmaster context use``
picks the current one. A token never comes from the command line, where every user of the
machine can read it (``/proc/PID/cmdline``): ``context add`` reads it from ``--token-file``,
from ``TRAINMASTER_TOKEN``, or from standard input.

:func:`resolve` is the one place a remote verb learns its server and token, in this order:

1. ``--context NAME`` (or ``$TRAINMASTER_CONTEXT``): that context; ``--server`` may override its URL;
2. ``--server URL`` (or ``$TRAINMASTER_SERVER``): that URL, with the token of
   ``$TRAINMASTER_TOKEN``, else of the file ``$TRAINMASTER_TOKEN_FILE``, else of a saved context
   with that server;
3. neither: the current context, if one is set; else no server (the verb uses the local store).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
import yaml

from trainmaster.errors import UserError

CONTEXTS_FILE = "contexts.yaml"
NAME_HELP = "A name of your choice for this server (letters, digits, '-', '_', '.')."

ContextOpt = Annotated[
    Optional[str],
    typer.Option(
        "--context",
        envvar="TRAINMASTER_CONTEXT",
        help="A saved server and its token (`trainmaster context add`); default: the current context, if any.",
    ),
]


@dataclass(frozen=True)
class Remote:
    """A controller service and the token it wants (None: it runs open, on loopback)."""

    server: str
    token: str | None = None


def contexts_path() -> Path:
    from trainmaster.store.db import home

    return home() / CONTEXTS_FILE


def _load() -> dict[str, Any]:
    path = contexts_path()
    if not path.exists():
        return {"current": None, "contexts": {}}
    from trainmaster.spec.boundedyaml import load_one

    try:
        data = load_one(path.read_text(encoding="utf-8"), str(path))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is damaged ({exc}); fix it or remove it and add the contexts again") from None
    if not isinstance(data, dict) or not isinstance(data.get("contexts", {}), dict):
        raise UserError(f"{path} is not a contexts file; remove it and add the contexts again")
    data.setdefault("contexts", {})
    data.setdefault("current", None)
    return data


def _save(data: dict[str, Any]) -> None:
    from trainmaster.service.secrets import write_secret

    write_secret(contexts_path(), yaml.safe_dump(data, sort_keys=True))


def _token_from_environment() -> str | None:
    token = os.environ.get("TRAINMASTER_TOKEN", "").strip()
    if token:
        return token
    token_file = os.environ.get("TRAINMASTER_TOKEN_FILE")
    if token_file:
        from trainmaster.service.secrets import read_token_file

        return read_token_file(Path(token_file).expanduser())
    return None


def resolve(server: str | None, context: str | None) -> Remote | None:
    """The service a remote verb talks to and its token (see the module doc); None: no server."""
    data = _load()
    if context:
        found = data["contexts"].get(context)
        if not isinstance(found, dict):
            known = ", ".join(sorted(data["contexts"])) or "none saved"
            raise UserError(f"no context '{context}' (known: {known}); add it with `trainmaster context add`")
        return Remote((server or found["server"]).rstrip("/"), _token_from_environment() or found.get("token"))
    if server:
        server = server.rstrip("/")
        token = _token_from_environment()
        if token is None:
            token = next(
                (c.get("token") for c in data["contexts"].values() if str(c.get("server", "")).rstrip("/") == server),
                None,
            )
        return Remote(server, token)
    current = data.get("current")
    if current and isinstance(data["contexts"].get(current), dict):
        chosen = data["contexts"][current]
        return Remote(str(chosen["server"]).rstrip("/"), _token_from_environment() or chosen.get("token"))
    return None


# ---- the `trainmaster context` commands ------------------------------------------------------
context_app = typer.Typer(
    help="Saved controller services and their tokens (as kubeconfig contexts): add, use, list, remove.",
    no_args_is_help=True,
)


def _check_name(name: str) -> None:
    if not name or len(name) > 63 or not all(c.isalnum() or c in "-_." for c in name):
        raise UserError(f"context name {name!r}: use letters, digits, '-', '_' or '.' (at most 63)")


@context_app.command("add")
def add(
    name: Annotated[str, typer.Argument(help=NAME_HELP)],
    server: Annotated[str, typer.Option("--server", help="The service's URL, e.g. http://10.0.0.5:8642.")],
    token_file: Annotated[
        Optional[Path],
        typer.Option(
            "--token-file",
            help="A file holding the token (mode 600). Without it: $TRAINMASTER_TOKEN, else one line of standard "
            "input; none at all for an open (loopback) server.",
        ),
    ] = None,
    use: Annotated[bool, typer.Option("--use/--no-use", help="Make it the current context.")] = True,
) -> None:
    """Save a server and its token under NAME (the token is never taken from the command line).

    Examples:

      trainmaster context add lab --server http://10.0.0.5:8642 --token-file ~/lab.token

      TRAINMASTER_TOKEN=... trainmaster context add lab --server http://10.0.0.5:8642
    """
    from urllib.parse import urlsplit

    from trainmaster.service.secrets import read_token_file

    _check_name(name)
    parts = urlsplit(server)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UserError(f"--server {server!r}: give the service's URL, e.g. http://10.0.0.5:8642")
    if token_file is not None:
        token: str | None = read_token_file(token_file.expanduser())
    elif os.environ.get("TRAINMASTER_TOKEN"):
        token = os.environ["TRAINMASTER_TOKEN"].strip()
    elif not sys.stdin.isatty():
        token = sys.stdin.readline().strip() or None
    else:
        token = typer.prompt("token (empty: the server runs open)", default="", hide_input=True, show_default=False)
        token = token.strip() or None
    data = _load()
    data["contexts"][name] = {"server": server.rstrip("/"), **({"token": token} if token else {})}
    if use or not data.get("current"):
        data["current"] = name
    _save(data)
    print(
        f"context {name}: {server.rstrip('/')} ({'with a token' if token else 'no token'})"
        + ("; current" if data["current"] == name else "")
    )


@context_app.command("use")
def use_context(name: Annotated[str, typer.Argument(help="A saved context.")]) -> None:
    """Make NAME the current context: remote verbs without --server or --context talk to it.

    Examples:

      trainmaster context use lab

      trainmaster job list          # now asks lab's server, with its token
    """
    data = _load()
    if name not in data["contexts"]:
        raise UserError(f"no context '{name}' (known: {', '.join(sorted(data['contexts'])) or 'none saved'})")
    data["current"] = name
    _save(data)
    print(f"current context: {name} ({data['contexts'][name]['server']})")


@context_app.command("list")
def list_contexts() -> None:
    """List the saved contexts (the current one starred; tokens are never shown).

    Examples:

      trainmaster context list
    """
    data = _load()
    if not data["contexts"]:
        print("no contexts saved; add one with `trainmaster context add NAME --server URL`")
        return
    for name in sorted(data["contexts"]):
        entry = data["contexts"][name]
        mark = "*" if name == data.get("current") else " "
        print(f"{mark} {name}\t{entry.get('server')}\t{'token' if entry.get('token') else 'no token'}")


@context_app.command("remove")
def remove(name: Annotated[str, typer.Argument(help="A saved context.")]) -> None:
    """Forget a saved context and its token.

    Examples:

      trainmaster context remove lab
    """
    data = _load()
    if data["contexts"].pop(name, None) is None:
        raise UserError(f"no context '{name}'")
    if data.get("current") == name:
        data["current"] = None
    _save(data)
    print(f"context {name} removed")


def register(app: typer.Typer) -> None:
    app.add_typer(context_app, name="context")
