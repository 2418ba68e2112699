"""Ray's token authentication, as a head started where `~/.ray/auth_token` exists expects it.

`ray start --head` turns token authentication on where a token file exists (or RAY_AUTH_TOKEN is
set), but a driver that joins it sends the token only with RAY_AUTH_MODE=token: without it every
`af.up` / `af.connect` / `aaflow submit` failed with "cannot reach a Ray cluster". A process's auth
mode cannot change once Ray ran in it, so this is set before a process first joins a cluster, and
in the environment of the processes it starts.
"""

from __future__ import annotations

import os
from pathlib import Path

from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available


def token_exists(env=os.environ) -> bool:
    """A Ray auth token is there for `env`: RAY_AUTH_TOKEN, or the file RAY_AUTH_TOKEN_PATH names
    (by default ~/.ray/auth_token)."""
    path = Path(env.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    return bool(env.get("RAY_AUTH_TOKEN")) or path.exists()


def with_token_auth(env: dict) -> dict:
    """`env` with RAY_AUTH_MODE=token where a token exists and no mode is chosen (changed in place)."""
    if "RAY_AUTH_MODE" not in env and token_exists(env):
        env["RAY_AUTH_MODE"] = "token"
    return env


def enable_here() -> None:
    """Token authentication for this process where a token exists and no mode is chosen, as Ray's
    own `ray start` decides it for a head. Ray caches its auth mode when it is imported: setting
    RAY_AUTH_MODE in `os.environ` afterwards is not seen unless its config is refreshed, which Ray's
    helper does (the `aaflow` commands import Ray before they join a cluster)."""
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def auth_hint(error: BaseException) -> str:
    """What to do about an authentication failure joining a cluster ('' for other errors)."""
    text = str(error)
    if "InvalidAuthToken" not in text and "Unauthenticated" not in text:
        return ""
    return (" (the cluster wants Ray's auth token: set RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH to the head's token "
            "file, with RAY_AUTH_MODE=token; or start the head with RAY_AUTH_MODE=disabled)")
