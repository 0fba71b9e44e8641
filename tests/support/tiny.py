"""The sizes of a tiny Llama/Qwen2-style decoder for tests that build one from a config."""

TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)
