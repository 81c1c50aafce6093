"""A small OpenAI-compatible server standing in for vLLM and SGLang (which need GPUs): canned replies,
routing in vLLM's documented `routed_experts` shape ([tokens, layers, top_k] per choice), and SGLang's
expert-distribution record endpoints. Runs in-process on a loopback port (uvicorn on a thread)."""

from __future__ import annotations

import json
import time

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from engine.serve.runner import ServerThread, listen

LAYERS, EXPERTS, TOP_K = 3, 6, 2
REPLY = ["Hello", " from", " the", " stand", "-in", "."]


def routing_for(tokens: int) -> np.ndarray:
    """[tokens, layers, top_k]: layer l sends every token to experts l and l+1 (a pattern a test can see)."""
    picks = np.array([[layer % EXPERTS, (layer + 1) % EXPERTS] for layer in range(LAYERS)], dtype=np.int16)
    return np.broadcast_to(picks, (tokens, LAYERS, TOP_K)).copy()


def create_standin(kind: str = "vllm", model: str = "standin/moe-model") -> FastAPI:
    """kind: "vllm" (routed_experts on each choice), "sglang" (the record endpoints), "plain" (no routing)."""
    app = FastAPI()
    app.state.requests = []
    record = {"on": False, "counts": np.zeros((LAYERS, EXPERTS), dtype=np.int64)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": kind, "max_model_len": 4096}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        app.state.requests.append(body)
        if body.get("model") != model:
            return JSONResponse({"error": {"message": f"The model `{body.get('model')}` does not exist."}}, 404)
        tokens = REPLY[: int(body.get("max_tokens") or len(REPLY))]
        routed = routing_for(len(tokens) - 1)  # vLLM: the last token is never fed back
        if record["on"]:
            for layer in range(LAYERS):
                np.add.at(record["counts"][layer], routed[:, layer, :].ravel(), 1)
        extra = {"routed_experts": routed.tolist()} if kind == "vllm" else {}
        usage = {"prompt_tokens": 7, "completion_tokens": len(tokens), "total_tokens": 7 + len(tokens)}
        finish = "length" if len(tokens) < len(REPLY) else "stop"
        if not body.get("stream"):
            return {"id": "chatcmpl-standin", "object": "chat.completion", "created": int(time.time()), "model": model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(tokens)},
                                 "finish_reason": finish, **extra}], "usage": usage}

        async def events():
            head = {"id": "chatcmpl-standin", "object": "chat.completion.chunk", "model": model}
            for token in tokens:
                yield f"data: {json.dumps({**head, 'choices': [{'index': 0, 'delta': {'content': token}}]})}\n\n"
            last = {"index": 0, "delta": {}, "finish_reason": finish, **extra}
            yield f"data: {json.dumps({**head, 'choices': [last]})}\n\n"
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    if kind == "sglang":
        @app.post("/start_expert_distribution_record")
        async def start():
            record["on"], record["counts"][:] = True, 0
            return PlainTextResponse("Start recording the expert distribution.\n")

        @app.post("/stop_expert_distribution_record")
        async def stop():
            record["on"] = False
            return PlainTextResponse("Stop recording the expert distribution.\n")

        @app.post("/dump_expert_distribution_record")
        async def dump():
            # SGLang's record dict ("stat" mode): logical_count [layers, experts]; reset after the dump
            counts, record["counts"] = record["counts"].tolist(), np.zeros((LAYERS, EXPERTS), dtype=np.int64)
            return {"logical_count": counts}

    return app


class StandIn:
    def __init__(self, kind: str = "vllm") -> None:
        self.app = create_standin(kind)
        self.thread = ServerThread(self.app, listen("127.0.0.1", 0))
        self.url = self.thread.url

    def __enter__(self) -> StandIn:
        self.thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.thread.stop()

    @property
    def requests(self) -> list[dict]:
        return self.app.state.requests
