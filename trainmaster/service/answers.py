"""JSON answers of the read routes (a job list, a job's status), rendered in the worker thread
that read the store.

A route that returns a ``dict`` costs the event loop two more steps under load: FastAPI validates
the dict against its return annotation in another worker thread (one more hop between threads,
each waiting its turn for the interpreter lock behind the submits being parsed), then walks it
again on the event loop to make it JSON. Rendered here, once, by pydantic's serialiser (Rust),
the answer leaves as bytes. Non-finite floats (a reported loss of NaN) become ``null``, as
FastAPI's own rendering made them: JSON has no NaN.
"""

from __future__ import annotations

from typing import Any

from fastapi import Response
from pydantic_core import to_json


def json_answer(data: Any, status_code: int = 200) -> Response:
    """``data`` (plain JSON types) as a JSON response."""
    return Response(to_json(data, inf_nan_mode="null"), status_code, media_type="application/json")
