"""Model inference: fetching and running the chat model."""
