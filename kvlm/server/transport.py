"""What every API's routes share on the HTTP side: Server-Sent Events, and noticing a client that left."""
from __future__ import annotations

import asyncio
import json

from fastapi import Request

DISCONNECT_POLL_S = 0.25
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the response


def sse(body: dict, event: str | None = None) -> str:
    """One event; `event` names its type on a line of its own (the Responses and Messages APIs' streams)."""
    head = f"event: {event}\n" if event else ""
    return head + f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def until_disconnected(request: Request, work: asyncio.Future):
    """Await `work`; None if the client went away first, in which case `work` is cancelled (aborting its
    requests)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
