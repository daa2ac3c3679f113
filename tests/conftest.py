"""Shared test settings: no Prefect telemetry, no stray MLflow store in the working folder."""

import os
import signal

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")

# Run from a background shell (`make test &`, nohup, some CI runners) this process starts with
# SIGINT ignored, and every local job controller the tests start would inherit that and ignore
# the SIGINT that cancels it. What a terminal gives: Ctrl-C raises KeyboardInterrupt.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
