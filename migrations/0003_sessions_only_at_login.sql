-- A session now starts only at login (or setup): a visitor who has not logged in gets a CSRF
-- token tied to a nonce in their cookie and a key in `meta`, and no row. The anonymous rows of
-- earlier versions go, and `user_id` becomes required so that none can come back.
CREATE TABLE sessions_at_login (
    token      TEXT    PRIMARY KEY,
    user_id    INTEGER NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    csrf       TEXT    NOT NULL,
    expires_at INTEGER NOT NULL
);
INSERT INTO sessions_at_login (token, user_id, csrf, expires_at)
    SELECT token, user_id, csrf, expires_at FROM sessions WHERE user_id IS NOT NULL;
DROP TABLE sessions;
ALTER TABLE sessions_at_login RENAME TO sessions;
CREATE INDEX sessions_by_expiry ON sessions (expires_at);
-- A login trims the user's oldest sessions, and deleting a user deletes theirs.
CREATE INDEX sessions_by_user ON sessions (user_id, expires_at);
