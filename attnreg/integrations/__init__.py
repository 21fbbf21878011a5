"""Adapters that let inference engines run their graphs' attention nodes with attnreg.

- :mod:`attnreg.integrations.onnx`: the standard ONNX ``Attention`` op (opset 23+) and
  com.microsoft ``GroupQueryAttention`` / ``MultiHeadAttention`` nodes (needs ``onnx``).

Nothing here is imported by ``import attnreg``; each adapter imports its engine lazily.
"""
