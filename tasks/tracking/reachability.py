"""Bounded waits on the MLflow tracking server in the flow process.

MLflow's client retries a failed HTTP request 7 times with a backoff factor of 2 and waits
120 s for each answer: one call to a dead server takes ~4 minutes, and a flow failing on a
dead server used to spend 10+ minutes marking its runs FAILED. The flow process uses shorter
defaults (a call then fails in ~10 s); a value set in the environment is kept.
"""

import os
import urllib.error
import urllib.request

# ~0 + 2 + 4 s of backoff (+ up to 1 s jitter each) before a call to a dead server fails.
_FLOW_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}


def limit_http_retries() -> None:
    """Shorter MLflow HTTP retries for this process, unless the environment sets them."""
    for name, value in _FLOW_DEFAULTS.items():
        os.environ.setdefault(name, value)


def reachable(tracking_uri: str, timeout_s: float = 3.0) -> bool:
    """Whether an HTTP tracking server answers its /health page; True for local stores."""
    if not tracking_uri.startswith(("http://", "https://")):
        return True
    url = tracking_uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return True
    except urllib.error.HTTPError:
        return True  # it answered (e.g. 401 behind auth)
    except OSError:
        return False
