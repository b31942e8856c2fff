"""Running the pipeline: Prefect deployments and DVC commands from flows."""
