"""The chat page for people: `GET /` and its static files under `/assets/`, no build step.

The page talks to the OpenAI-compatible route like any other client (web/dialects/openai_api.py);
nothing here touches a job. Open without a key: it holds no data, and asks for a key when
the API answers 401.
"""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, send_from_directory

STATIC = Path(__file__).resolve().parent / "static"
STATIC_URL = "/assets"  # not /static: Flask keeps that for the app's own folder


def blueprint() -> Blueprint:
    bp = Blueprint("page", __name__, static_folder=str(STATIC), static_url_path=STATIC_URL)

    @bp.get("/", provide_automatic_options=False)
    def index():
        return send_from_directory(STATIC, "index.html")

    return bp
