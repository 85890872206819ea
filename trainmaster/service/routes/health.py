"""``/healthz``: whether the reconcile loop runs without error, and who leads."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from trainmaster.service.state import service_of

router = APIRouter()


@router.get("/healthz")
def healthz(request: Request) -> dict[str, Any]:
    service = service_of(request)
    error = service.reconciler.error
    return {"ok": error is None, "error": error, **service.leadership()}
