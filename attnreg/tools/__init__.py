"""What stands on the core: the CLI, the bench, tuning, the conformance matrix, the peers and
the text UI. Tools reach backends only through the registry (an import-linter contract in
pyproject.toml keeps it so)."""
