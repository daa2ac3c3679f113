"""Where work runs: dask clusters and submitit executors. No ML logic here."""
