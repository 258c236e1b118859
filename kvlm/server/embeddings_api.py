"""OpenAI's embeddings endpoint: `POST /v1/embeddings` for every served model (kvlm.engine.pooling).

Input: a string, a list of strings, a list of token ids or a list of such lists (at most MAX_INPUTS); each is one
embedding request, batched through the engine beside generation. `encoding_format` "float" or "base64" (the
float32 values' little-endian bytes, as OpenAI's SDK decodes them); `dimensions` keeps the first values, normalized
again. Pooling is the server's (--pooling), by default the model's own.
"""
from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import Callable
from typing import Literal

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictInt

from kvlm.engine.pooling import checked_dimensions, truncated
from kvlm.server.protocol import BadRequest
from kvlm.server.model_set import ModelSet
from kvlm.server.transport import CLIENT_CLOSED_REQUEST, until_disconnected

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        if isinstance(self.input, str):
            return [self.input]
        if not self.input:
            raise BadRequest("input must not be empty", "input")
        inputs = [list(self.input)] if all(isinstance(i, int) for i in self.input) else list(self.input)
        if len(inputs) > MAX_INPUTS:
            raise BadRequest(f"input takes at most {MAX_INPUTS} entries, got {len(inputs)}", "input")
        return inputs


def encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")


def add_embeddings_routes(app: FastAPI, models: ModelSet, authorized: Callable) -> None:
    @app.post("/v1/embeddings", dependencies=[Depends(authorized)])
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        served = await models.get(body.model)
        try:
            checked_dimensions(body.dimensions, served.engine.model.config.n_embd)
        except ValueError as exc:
            raise BadRequest(str(exc), "dimensions") from None
        prompts = [served.token_ids(text, f"input[{i}]") for i, text in enumerate(body.inputs())]
        for i, ids in enumerate(prompts):
            if len(ids) >= served.engine.n_ctx:
                raise BadRequest(f"input[{i}] has {len(ids)} tokens; this model's maximum context length is "
                                 f"{served.engine.n_ctx} tokens", f"input[{i}]", code="context_length_exceeded")
        batch = f"embd-{uuid.uuid4().hex}"
        outputs = await until_disconnected(
            request, asyncio.gather(*(served.embed(f"{batch}-{i}", ids) for i, ids in enumerate(prompts))))
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        for i, output in enumerate(outputs):
            if output.error:
                raise BadRequest(output.error, f"input[{i}]")
        n_tokens = sum(map(len, prompts))
        return JSONResponse({
            "object": "list", "model": served.name,
            "data": [{"object": "embedding", "index": i,
                      "embedding": encoded(truncated(o.embedding, body.dimensions), body.encoding_format)}
                     for i, o in enumerate(outputs)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})
