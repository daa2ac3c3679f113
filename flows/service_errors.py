"""Readable messages for a Prefect or MLflow server that refuses our credentials, and for an
MLflow tracking server that cannot be reached.

A refused login otherwise ends `trainflow run` with a long traceback from deep inside a
client library; what the user needs is which server refused and which setting to fix.
"""

import os
import re

import httpx
from mlflow.exceptions import MlflowException

_REFUSED = (401, 403)
# MLflow's wording once its HTTP retries are spent.
_UNREACHABLE = re.compile(r"API request to (https?://[^/\s]+)\S* failed with (timeout )?exception")


def explain_refusal(err: BaseException) -> str | None:
    """What to fix when `err` (or an error it was raised from) is an HTTP 401/403 of the
    MLflow tracking server or the Prefect API, or an unreachable MLflow server; None for
    every other error."""
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
    unreachable = _UNREACHABLE.match(err.message) if isinstance(err, MlflowException) else None
    if unreachable:
        why = "connection refused" if "Connection refused" in str(err) else "no answer"
        return (
            f"the MLflow tracking server {unreachable.group(1)} cannot be reached ({why}, after "
            "retries): start it again, or set tracking.tracking_uri to a server that runs"
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
