"""API documentation pages that work offline: Swagger UI at ``/docs`` and ReDoc at ``/redoc``.

FastAPI's own pages load their scripts and styles from a public CDN, so on a machine with no internet they render
blank. These pages load the same tools from files shipped in the package (``rollhub/server/static``, versions and
licences in its README), served under ``/static``. The pages and assets carry no buffer data, so they are open
without the API key, as is the schema they render.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"


# Each page's packaged assets: its keyword argument of FastAPI's page function, and the file under /static.
SWAGGER_ASSETS = {
    "swagger_js_url": "swagger-ui/swagger-ui-bundle.js",
    "swagger_css_url": "swagger-ui/swagger-ui.css",
    "swagger_favicon_url": "swagger-ui/favicon-32x32.png",
}
REDOC_ASSETS = {"redoc_js_url": "redoc/redoc.standalone.js", "redoc_favicon_url": "swagger-ui/favicon-32x32.png"}


def _page(request: Request, tool: str, assets: dict[str, str]) -> dict[str, str]:
    """The keyword arguments of ``tool``'s page: the app's schema URL and title, and the URLs of ``assets`` under
    the app's root path."""
    root = request.scope.get("root_path", "")
    urls = {name: f"{root}/static/{path}" for name, path in assets.items()}
    return {"openapi_url": f"{root}{request.app.openapi_url}", "title": f"{request.app.title} - {tool}", **urls}


def router() -> APIRouter:
    """``/docs`` (Swagger UI) and ``/redoc``, rendering the app's own ``openapi_url`` with packaged assets."""
    api = APIRouter(include_in_schema=False)

    @api.get("/docs")
    async def swagger_ui(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(**_page(request, "Swagger UI", SWAGGER_ASSETS))

    @api.get("/redoc")
    async def redoc(request: Request) -> HTMLResponse:
        return get_redoc_html(**_page(request, "ReDoc", REDOC_ASSETS), with_google_fonts=False)

    return api


def install_docs(app: FastAPI) -> None:
    """Serve ``/docs``, ``/redoc`` and ``/static`` from the package. Build ``app`` with ``docs_url=None`` and
    ``redoc_url=None`` so FastAPI's CDN pages are not registered as well."""
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.include_router(router())
