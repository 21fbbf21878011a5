"""The float64 numpy reference as a backend: always available, slow, exact."""
