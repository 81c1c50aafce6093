"""The OpenAI- and Ollama-compatible HTTP server: the loaded model for editors, agents and scripts.

Torch-free (like `engine.process.client`): it speaks to the engine worker only through the protocol,
on the client it is handed, so `moescope serve` (its own client) and the window (the window's
client, shared with the chat) serve the very same engine. Requests queue FIFO for a place in its
batch (engine.process.batch: up to `parallel` replies decode together).
"""

DEFAULT_PORT = 8377  # beside LM Studio's 1234, Ollama's 11434 and vLLM's 8000, so they can run together
