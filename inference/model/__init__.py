"""The forward pass: the decoder step over every running sequence, its KV cache, rotary tables."""
