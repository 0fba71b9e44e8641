"""Getting a model: the ModelScope download, the embedded model, integrity checks, reading a
checkpoint layer by layer, and assembling the engine the worker serves."""
