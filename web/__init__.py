"""The HTTP side: the Flask app, request validation, SSE. It never touches the model."""
