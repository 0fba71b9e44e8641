"""`python -m bench` by default: the engine vs transformers (and llama.cpp), a process each."""
