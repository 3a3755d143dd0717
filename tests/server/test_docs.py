"""/docs and /redoc work with no network: their scripts and styles are served by rollhub from the package."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from rollhub.server import ServerSettings, create_app, route_docs
from rollhub.server.docs import STATIC_DIR
from rollhub.server.middleware import OPEN_PATHS

ASSET_REFS = re.compile(r"""(?:src|href)=["']([^"']+)["']|url:\s*["']([^"']+)["']""")


def _client(api_key: str | None = None) -> TestClient:
    return TestClient(create_app(ServerSettings(storage="memory", api_key=api_key)))


def _refs(html: str) -> list[str]:
    return [a or b for a, b in ASSET_REFS.findall(html)]


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_doc_pages_load_every_asset_from_the_server_itself(page: str) -> None:
    with _client() as client:
        answer = client.get(page)
        assert answer.status_code == 200
        refs = _refs(answer.text)
        assert refs, answer.text
        for ref in refs:
            # Every script, style, icon and the schema itself come from this server: nothing external.
            assert ref.startswith("/"), f"{page} loads {ref!r} from outside the server"
            asset = client.get(ref)
            assert asset.status_code == 200, ref
            assert asset.content, ref
        assert "fonts.googleapis" not in answer.text


def test_the_assets_are_the_real_tools_with_their_licences() -> None:
    with _client() as client:
        js = client.get("/static/swagger-ui/swagger-ui-bundle.js")
        assert js.status_code == 200
        assert "javascript" in js.headers["content-type"]
        assert len(js.content) > 500_000 and b"SwaggerUIBundle" in js.content
        css = client.get("/static/swagger-ui/swagger-ui.css")
        assert "text/css" in css.headers["content-type"] and b".swagger-ui" in css.content
        redoc = client.get("/static/redoc/redoc.standalone.js")
        assert len(redoc.content) > 500_000 and b"Redoc" in redoc.content
        assert client.get("/static/../factory.py").status_code == 404
    for notice in ("swagger-ui/LICENSE", "swagger-ui/NOTICE", "redoc/LICENSE", "README.md"):
        assert (STATIC_DIR / notice).stat().st_size > 0, notice


def test_docs_need_no_key_but_data_routes_still_do() -> None:
    with _client(api_key="sekret") as client:
        for path in ("/docs", "/redoc", "/openapi.json", "/static/swagger-ui/swagger-ui.css"):
            assert client.get(path).status_code == 200, path
        assert client.get("/status").status_code == 401
        assert client.get("/static-not-really").status_code == 401
        assert client.get("/status", headers={"Authorization": "Bearer sekret"}).status_code == 200


def test_the_cdn_pages_of_the_framework_are_not_served() -> None:
    with _client() as client:
        html = client.get("/docs").text
        assert "cdn.jsdelivr.net" not in html and "unpkg.com" not in html
        paths = client.get("/openapi.json").json()["paths"]
        assert "/docs" not in paths and "/redoc" not in paths and not any(p.startswith("/static") for p in paths)


def test_every_route_has_a_summary_and_a_description_and_the_protected_ones_name_the_bearer_scheme() -> None:
    with _client() as client:
        schema = client.get("/openapi.json").json()
    operations = {(method, path): op for path, item in schema["paths"].items() for method, op in item.items()}
    assert set(operations) == set(route_docs.ROUTES)  # a new route needs its entry
    for (method, path), op in operations.items():
        summary, description = route_docs.ROUTES[(method, path)]
        assert (op["summary"], op["description"]) == (summary, description) and len(description) > 20
        protected = path not in OPEN_PATHS
        assert (op.get("security") == [{"bearer": []}]) == protected, path
        assert ("401" in op["responses"]) == protected, path
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert "wait for trainer to start" in operations[("post", "/register-env")]["description"]


def test_the_401_texts_have_no_angle_brackets_that_html_would_swallow() -> None:
    with _client(api_key="sekret") as client:
        answer = client.get("/status")
        schema = client.get("/openapi.json").json()
    assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer"
    assert answer.json()["detail"] == (
        "API key missing: send the header 'Authorization: Bearer KEY' where KEY is the server's --api-key"
    )
    described = schema["paths"]["/status"]["get"]["responses"]["401"]["description"]
    assert "Bearer KEY, where KEY is the server's --api-key" in described and "<" not in described
