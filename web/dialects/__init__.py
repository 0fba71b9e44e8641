"""The API dialects: each parses its own body into the one ChatRequest and renders events in its
own shape (/chat, the OpenAI /v1 routes); the relay, the Job and the worker are shared."""
