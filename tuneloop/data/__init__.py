"""The data path, in stage order: ingest, the pool, clean, pack, and their caches."""
