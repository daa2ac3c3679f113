"""Readable messages for a Prefect or MLflow server that refuses our credentials.

A refused login otherwise ends `trainflow run` with a long traceback from deep inside a
client library; what the user needs is which server refused and which setting to fix.
"""

import os

import httpx
from mlflow.exceptions import MlflowException

_REFUSED = (401, 403)


def explain_refusal(err: BaseException) -> str | None:
    """What to fix when `err` (or an error it was raised from) is an HTTP 401/403 of the
    MLflow tracking server or the Prefect API; None for every other error."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        message = _explain_one(current)
        if message:
            return message
        current = current.__cause__ or current.__context__
    return None


def _explain_one(err: BaseException) -> str | None:
    if isinstance(err, MlflowException) and err.get_http_status_code() in _REFUSED:
        uri = os.environ.get("MLFLOW_TRACKING_URI", "the MLflow tracking server")
        return (
            f"{uri} refused the request (HTTP {err.get_http_status_code()}: "
            f"{_first_line(err.message)}): set MLFLOW_TRACKING_USERNAME and "
            "MLFLOW_TRACKING_PASSWORD (or ~/.mlflow/credentials) to a user that may write "
            "to the experiment"
        )
    if isinstance(err, httpx.HTTPStatusError) and err.response.status_code in _REFUSED:
        api = os.environ.get("PREFECT_API_URL", str(err.request.url))
        return (
            f"the Prefect API at {api} refused the request (HTTP {err.response.status_code}): "
            "set PREFECT_API_AUTH_STRING=<user>:<password> (the server's "
            "PREFECT_SERVER_API_AUTH_STRING), in the environment or the Prefect profile"
        )
    return None


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:200]
