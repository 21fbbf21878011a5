"""A plugin module that fails on import, like one whose GPU library is missing."""

raise ImportError("libtoygpu.so.1: cannot open shared object file")
