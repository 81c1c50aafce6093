"""A conversation as Markdown (to read or share) or JSON (to re-import or script against)."""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import datetime

from app.models.history import Conversation, Message
from app.models.stats_format import reply_stats_line

ROLE_TITLES = {"user": "You", "assistant": "Assistant", "system": "System"}


def to_markdown(conversation: Conversation, messages: list[Message]) -> str:
    when = datetime.fromtimestamp(conversation.created).strftime("%Y-%m-%d %H:%M")
    lines = [f"# {conversation.title}", "", f"*{when}*" + (f" · model `{conversation.model}`" if conversation.model else ""), ""]
    if conversation.system_prompt:
        lines += ["## System", "", conversation.system_prompt, ""]
    for m in messages:
        lines += [f"## {ROLE_TITLES.get(m.role, m.role)}", "", m.content, ""]
        if m.stats:
            lines += [f"*{reply_stats_line(m.stats)}*", ""]
    return "\n".join(lines).rstrip() + "\n"


def to_json(conversation: Conversation, messages: list[Message]) -> str:
    data = {
        "title": conversation.title,
        "created": conversation.created,
        "model": conversation.model,
        "system_prompt": conversation.system_prompt,
        "sampling": asdict(conversation.sampling),
        "messages": [
            {"role": m.role, "content": m.content, "stats": asdict(m.stats) if m.stats else None,
             "finish_reason": m.finish_reason, "created": m.created}
            for m in messages
        ],
    }
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"
