"""The web administration page: / and its static files (no token: they hold no data).

SEE ALSO
    sluice/api/static, docs/api.md
"""

# No "from __future__ import annotations": FastAPI reads these annotations.
from importlib import resources
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

__all__ = ["STATIC", "add_page"]

STATIC = Path(str(resources.files("sluice.api").joinpath("static")))


def add_page(app: FastAPI) -> None:
    """Serve the web page at / and its files under /static."""
    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
