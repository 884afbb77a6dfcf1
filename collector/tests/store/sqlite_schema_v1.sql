-- The SQLite store's schema version 1 (before 2026-11-30), for the migration test.
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS actions (
    id INTEGER PRIMARY KEY,
    session_id TEXT,
    trace_id TEXT NOT NULL,
    span_id TEXT NOT NULL,
    status TEXT NOT NULL,
    action_id TEXT,
    kind TEXT,
    seq INTEGER,
    received_at REAL NOT NULL,
    record TEXT NOT NULL,
    UNIQUE (trace_id, span_id, status)
);
CREATE INDEX IF NOT EXISTS actions_by_session ON actions (session_id, id);
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    first_seen REAL NOT NULL,
    last_seen REAL NOT NULL,
    open INTEGER NOT NULL DEFAULT 1,
    ended_at REAL,
    actions INTEGER NOT NULL DEFAULT 0,
    errors INTEGER NOT NULL DEFAULT 0,
    warnings INTEGER NOT NULL DEFAULT 0,
    verdict TEXT NOT NULL DEFAULT 'ok'
);
CREATE INDEX IF NOT EXISTS sessions_idle ON sessions (open, last_seen);
CREATE INDEX IF NOT EXISTS sessions_by_verdict ON sessions (verdict, last_seen);
CREATE INDEX IF NOT EXISTS sessions_by_activity ON sessions (last_seen);
CREATE TABLE IF NOT EXISTS violations (
    id INTEGER PRIMARY KEY,
    key TEXT NOT NULL UNIQUE,
    session_id TEXT,
    rule TEXT NOT NULL,
    severity TEXT NOT NULL,
    message TEXT NOT NULL,
    action_id TEXT,
    trace_id TEXT,
    span_id TEXT,
    at_end INTEGER NOT NULL DEFAULT 0,
    resolved INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS violations_by_session ON violations (session_id, id);
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY,
    channel TEXT NOT NULL,
    violation_key TEXT NOT NULL,
    payload TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_at REAL NOT NULL,
    last_error TEXT,
    created_at REAL NOT NULL,
    delivered_at REAL,
    UNIQUE (channel, violation_key)
);
CREATE INDEX IF NOT EXISTS outbox_due ON outbox (channel, state, next_attempt_at);
