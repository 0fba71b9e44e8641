"""Who may use the service and who is asking: API keys and their file, the brake on key
guessing, and what a reverse proxy says about a request."""
