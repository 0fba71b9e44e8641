"""Two API keys the tests share, each of them long enough to be accepted."""

KEY = "k" * 20
OTHER = "o" * 24
