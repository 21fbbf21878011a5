"""Adapters that let inference engines run their graphs' attention nodes with attnreg.

- :mod:`attnreg.integrations.onnx`: the standard ONNX ``Attention`` op (opset 23+) and
  com.microsoft ``GroupQueryAttention`` / ``MultiHeadAttention`` nodes (needs ``onnx``).
- :mod:`attnreg.integrations.transformers`: ``register()`` puts attnreg into transformers'
  AttentionInterface and AttentionMaskInterface (needs ``torch`` and ``transformers``).

Nothing here is imported by ``import attnreg``; each adapter imports its engine lazily.
"""
