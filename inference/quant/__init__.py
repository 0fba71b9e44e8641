"""Quantized weights and their kernels: per-row int8 (fbgemm), int4, torch.ao, smoothing, the
embedding tables, and the one per-row weight quantizer both int8 paths share."""
