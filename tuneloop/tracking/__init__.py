"""Records of what ran: MLflow runs, lineage, the registry, recovery, results."""
