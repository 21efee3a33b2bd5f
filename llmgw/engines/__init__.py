"""Engine adapters: llama.cpp's llama-server, vLLM, and multi-node vLLM over Ray."""
