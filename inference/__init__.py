"""Everything about the model: settings, loading, prompts, the engine and the one worker thread."""
