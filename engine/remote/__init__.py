"""Remote engines: an OpenAI-compatible server (vLLM, SGLang, `moescope serve`, llama.cpp...) behind the
same interface as the local engine client, so the window chats with it unchanged.

Torch-free. The server's expert routing, when it reports any, feeds the heatmap: vLLM's
`routed_experts` (and `moescope serve`'s, the same shape), or SGLang's expert-distribution record.
"""
