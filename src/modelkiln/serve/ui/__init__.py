"""The web page at ``/`` (``kiln serve --no-ui`` turns it off): the models served, a chat
playground that streams, a form for encoder models and live figures from ``/metrics``.

Plain HTML, CSS and JavaScript in this folder, shipped in the package (pyproject's package-data):
no build step, nothing fetched from anywhere but this server. The page holds no data of its own;
everything it shows comes from the API (``/v1/models``, ``/v2/models/{m}``,
``/v1/chat/completions``, ``/v1/embeddings``, ``/v2/models/{m}/predict``, ``/metrics``).

With ``--api-key`` the page and its two files need no key, as llama-server's page: the user types
the key into the page, which sends it as ``Authorization: Bearer KEY`` on its API calls, and every
API route stays behind the key. The paths are an exact list, so an unknown path still gets the
401 every other route gets."""

from __future__ import annotations

from importlib import resources
from typing import Any

from starlette.responses import Response

# path → (file in this folder, content type)
ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/style.css": ("style.css", "text/css; charset=utf-8"),
}
PATHS = frozenset(ASSETS)  # open without the API key (``app.Gate``)

# The page runs only its own script and talks only to this server (connect-src 'self'), so a
# script injected by some answer could neither run nor send the key elsewhere; answers are
# written as text (textContent), never as HTML.
HEADERS = {
    "cache-control": "no-cache",
    "x-content-type-options": "nosniff",
    "content-security-policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
}


def register(app: Any) -> None:
    """GET routes for the page's files on a FastAPI app, read once here."""
    folder = resources.files(__package__)
    for path, (name, media_type) in ASSETS.items():
        body = folder.joinpath(name).read_bytes()
        app.add_api_route(path, _endpoint(body, media_type), methods=["GET"], include_in_schema=False)


def _endpoint(body: bytes, media_type: str) -> Any:
    async def asset() -> Response:
        return Response(body, media_type=media_type, headers=HEADERS)

    return asset
