"""MLflow helpers: run creation, batched metric logging, tags."""
