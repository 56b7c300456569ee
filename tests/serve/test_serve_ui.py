"""The web page at / (serve/ui/) over HTTP, on a real `kiln serve` of a tiny embedding model: its
files and their content types, the key rule (the page is open, the API is not, as llama-server's),
--no-ui, and that a wheel would carry the files. tests/serve/test_serve_ui_browser.py drives the page in
a real browser."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import httpx
import pytest

from modelkiln.serve import ui
from modelkiln.serve.settings import ServeSettings
from servers import Server
from helpers import REPO

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROOT = REPO
UI_FOLDER = ROOT / "src" / "modelkiln" / "serve" / "ui"


@pytest.fixture(scope="module")
def embedder(zoo) -> Path:
    return zoo.artifact("bert", "sentence-embeddings", precisions=("fp32",))


@pytest.fixture(scope="module")
def keyed(embedder):
    srv = Server([f"emb={embedder}", "--no-warmup"], env={"KILN_API_KEY": KEY})
    yield srv
    code, err = srv.stop()
    assert code == 0, err[-2000:]


def test_the_page_and_its_files_are_served_with_their_types_and_need_no_key(keyed):
    page = httpx.get(keyed.url + "/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"
    # every file the page names is served, each with its type, and nothing from elsewhere is named
    named = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sorted(named) == ["/ui/app.js", "/ui/style.css"]
    types = {"/ui/app.js": "text/javascript; charset=utf-8", "/ui/style.css": "text/css; charset=utf-8"}
    for path in named:
        asset = httpx.get(keyed.url + path)
        assert asset.status_code == 200 and asset.headers["content-type"] == types[path]
        assert asset.content == (UI_FOLDER / path.rsplit("/", 1)[1]).read_bytes()
    assert "http://" not in page.text + httpx.get(keyed.url + "/ui/app.js").text  # nothing fetched from elsewhere
    assert 'route="ui",status="200"' in httpx.get(keyed.url + "/metrics", headers=AUTH).text


def test_with_an_api_key_the_api_still_needs_it(keyed):
    for path in ("/v1/models", "/v2/models/emb", "/metrics", "/v2", "/ui/nope", "/index.html", "/nope"):
        answer = httpx.get(keyed.url + path)
        assert answer.status_code == 401 and "error" in answer.json(), path
    for path in ("/v1/models", "/v2/models/emb", "/metrics"):
        assert httpx.get(keyed.url + path, headers=AUTH).status_code == 200, path
    embed = {"model": "emb", "input": "a flute"}
    assert httpx.post(keyed.url + "/v1/embeddings", json=embed).status_code == 401
    answer = httpx.post(keyed.url + "/v1/embeddings", json=embed, headers=AUTH)
    assert answer.status_code == 200 and len(answer.json()["data"][0]["embedding"]) > 0
    assert httpx.post(keyed.url + "/", content=b"{}").status_code == 405  # the page is GET only


def test_no_ui_serves_no_page(embedder):
    srv = Server([f"emb={embedder}", "--no-warmup", "--no-ui"])
    try:
        for path in ui.PATHS:
            assert httpx.get(srv.url + path).status_code == 404, path
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["id"] == "emb"  # the API is all there
    finally:
        code, err = srv.stop()
    assert code == 0, err[-2000:]


def test_the_setting_and_the_wheel():
    assert ServeSettings().ui is True
    assert ServeSettings.from_env({"KILN_UI": "false"}).ui is False
    # pyproject's package-data carries every file of the page (a wheel of the package serves it too)
    data = re.search(r"^\[tool\.setuptools\.package-data\].*?^modelkiln = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(),
                     re.S | re.M)
    patterns = re.findall(r'"([^"]+)"', data.group(1))
    files = {f"serve/ui/{name}" for name, _ in ui.ASSETS.values()}
    assert files == {f"serve/ui/{p.name}" for p in UI_FOLDER.iterdir() if p.suffix != ".py" and p.is_file()}
    for name in files:
        assert any(fnmatch.fnmatch(name, p) for p in patterns), name
