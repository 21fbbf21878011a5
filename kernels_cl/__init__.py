"""OpenCL C sources of the attention families, read with importlib.resources."""
