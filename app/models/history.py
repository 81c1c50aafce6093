"""Chat history in SQLite: conversations, their settings, and their messages (Qt-free).

The file lives under platformdirs' user data dir. WAL mode with synchronous=NORMAL keeps each
streamed write cheap while surviving a crash of the app (only the OS crashing can lose the last
commits).
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from platformdirs import user_data_dir

from engine.protocol import CONTEXT_OVERFLOW, ReplyStats, SamplingSettings

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    sampling TEXT NOT NULL DEFAULT '{}',
    model TEXT NOT NULL DEFAULT '',
    context_overflow TEXT NOT NULL DEFAULT 'drop-oldest',
    memory_start INTEGER
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    stats TEXT,
    finish_reason TEXT,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""

# columns added since the first release, added in place to an older file: (name, declaration)
ADDED_COLUMNS = {"conversations": (("context_overflow", "TEXT NOT NULL DEFAULT 'drop-oldest'"),
                                   ("memory_start", "INTEGER"))}
CONVERSATION_COLUMNS = "id, title, created, updated, system_prompt, sampling, model, context_overflow, memory_start"

DEFAULT_TITLE = "New chat"
DEFAULT_OVERFLOW = "drop-oldest"  # protocol.CONTEXT_OVERFLOW's first: the chat keeps going


def default_history_path() -> Path:
    return Path(user_data_dir("moescope", appauthor=False)) / "history.sqlite3"


def sampling_from_dict(data: dict) -> SamplingSettings:
    known = set(SamplingSettings.__dataclass_fields__)
    base = asdict(SamplingSettings())
    base.update({k: v for k, v in data.items() if k in known})
    return SamplingSettings(**base)


@dataclass
class Conversation:
    id: int
    title: str
    created: float
    updated: float
    system_prompt: str = ""
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    model: str = ""
    context_overflow: str = DEFAULT_OVERFLOW  # what the engine does when the history outgrows the context
    memory_start: int | None = None  # the first message the model saw in the last reply, when older ones were left out


@dataclass
class Message:
    id: int
    conversation_id: int
    role: str  # user | assistant | system
    content: str
    stats: ReplyStats | None = None
    finish_reason: str | None = None
    created: float = 0.0


class HistoryStore:
    def __init__(self, path: Path | str | None = None) -> None:
        self.path = Path(path) if path is not None else default_history_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # The GUI thread is the only user; autocommit keeps every write durable on its own.
        self.db = sqlite3.connect(self.path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)
        self._add_missing_columns()

    def close(self) -> None:
        self.db.close()

    def _add_missing_columns(self) -> None:
        """A file written by an older version gets the newer columns, with their defaults."""
        for table, columns in ADDED_COLUMNS.items():
            present = {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}
            for name, declaration in columns:
                if name not in present:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {declaration}")

    # ----- conversations -----
    def create_conversation(self, title: str = DEFAULT_TITLE, system_prompt: str = "",
                            sampling: SamplingSettings | None = None, model: str = "",
                            context_overflow: str = DEFAULT_OVERFLOW) -> Conversation:
        now = time.time()
        sampling = sampling or SamplingSettings()
        cur = self.db.execute(
            "INSERT INTO conversations(title, created, updated, system_prompt, sampling, model, context_overflow) "
            "VALUES (?,?,?,?,?,?,?)",
            (title, now, now, system_prompt, json.dumps(asdict(sampling)), model, context_overflow),
        )
        return Conversation(int(cur.lastrowid), title, now, now, system_prompt, sampling, model, context_overflow)

    def conversation(self, conversation_id: int) -> Conversation | None:
        row = self.db.execute(
            f"SELECT {CONVERSATION_COLUMNS} FROM conversations WHERE id=?", (conversation_id,),
        ).fetchone()
        return _conversation(row) if row else None

    def conversations(self, search: str = "") -> list[Conversation]:
        """Newest first; `search` matches titles, case-insensitively."""
        pattern = "%" + search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        rows = self.db.execute(
            f"SELECT {CONVERSATION_COLUMNS} FROM conversations "
            "WHERE title LIKE ? ESCAPE '\\' ORDER BY updated DESC, id DESC",
            (pattern,),
        ).fetchall()
        return [_conversation(r) for r in rows]

    def rename(self, conversation_id: int, title: str) -> None:
        self.db.execute("UPDATE conversations SET title=? WHERE id=?", (title.strip() or DEFAULT_TITLE, conversation_id))

    def update_settings(self, conversation_id: int, system_prompt: str, sampling: SamplingSettings) -> None:
        self.db.execute("UPDATE conversations SET system_prompt=?, sampling=? WHERE id=?",
                        (system_prompt, json.dumps(asdict(sampling)), conversation_id))

    def set_context_overflow(self, conversation_id: int, context_overflow: str) -> None:
        self.db.execute("UPDATE conversations SET context_overflow=? WHERE id=?", (context_overflow, conversation_id))

    def set_memory_start(self, conversation_id: int, message_id: int | None) -> None:
        """Where the model's memory started in the last reply (None: it saw the whole history)."""
        self.db.execute("UPDATE conversations SET memory_start=? WHERE id=?", (message_id, conversation_id))

    def set_model(self, conversation_id: int, model: str) -> None:
        self.db.execute("UPDATE conversations SET model=? WHERE id=?", (model, conversation_id))

    def delete_conversation(self, conversation_id: int) -> None:
        self.db.execute("DELETE FROM conversations WHERE id=?", (conversation_id,))

    def touch(self, conversation_id: int) -> None:
        self.db.execute("UPDATE conversations SET updated=? WHERE id=?", (time.time(), conversation_id))

    # ----- messages -----
    def add_message(self, conversation_id: int, role: str, content: str, stats: ReplyStats | None = None,
                    finish_reason: str | None = None) -> Message:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO messages(conversation_id, role, content, stats, finish_reason, created) VALUES (?,?,?,?,?,?)",
            (conversation_id, role, content, _dump(stats), finish_reason, now),
        )
        self.touch(conversation_id)
        return Message(int(cur.lastrowid), conversation_id, role, content, stats, finish_reason, now)

    def update_message(self, message_id: int, content: str, stats: ReplyStats | None = None,
                       finish_reason: str | None = None) -> None:
        self.db.execute("UPDATE messages SET content=?, stats=?, finish_reason=? WHERE id=?",
                        (content, _dump(stats), finish_reason, message_id))

    def messages(self, conversation_id: int) -> list[Message]:
        rows = self.db.execute(
            "SELECT id, conversation_id, role, content, stats, finish_reason, created FROM messages "
            "WHERE conversation_id=? ORDER BY id",
            (conversation_id,),
        ).fetchall()
        return [Message(r[0], r[1], r[2], r[3], _load_stats(r[4]), r[5], r[6]) for r in rows]

    def delete_messages_from(self, conversation_id: int, message_id: int) -> None:
        """Drop `message_id` and everything after it (regenerate, edit-and-resend)."""
        self.db.execute("DELETE FROM messages WHERE conversation_id=? AND id>=?", (conversation_id, message_id))


def _dump(stats: ReplyStats | None) -> str | None:
    return json.dumps(asdict(stats)) if stats is not None else None


def _load_stats(text: str | None) -> ReplyStats | None:
    """A stored reply's statistics; rows of older or newer versions keep what both know."""
    if not text:
        return None
    try:
        data = json.loads(text)
        return ReplyStats.from_dict(data) if isinstance(data, dict) else None
    except (ValueError, TypeError):
        return None


def _conversation(row) -> Conversation:
    try:
        sampling = sampling_from_dict(json.loads(row[5] or "{}"))
    except (ValueError, TypeError):
        sampling = SamplingSettings()  # a hand-edited or older row must not stop the app
    overflow = row[7] if row[7] in CONTEXT_OVERFLOW else DEFAULT_OVERFLOW
    return Conversation(row[0], row[1], row[2], row[3], row[4] or "", sampling, row[6] or "", overflow, row[8])
