-- Personal API tokens and a webhook per user.
--
-- A token is shown once, when it is made; only its SHA-256 is kept (the token is 32 random
-- bytes, so a fast hash is enough: nobody can guess one to test against it). Revoking a token
-- deletes its row, and deleting a user deletes their tokens, so either stops it at once.
CREATE TABLE api_tokens (
    id           INTEGER PRIMARY KEY,
    user_id      INTEGER NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    name         TEXT    NOT NULL,
    token_hash   TEXT    NOT NULL UNIQUE,  -- hex SHA-256 of the whole token
    prefix       TEXT    NOT NULL,         -- the token's first characters, to tell tokens apart
    created_at   INTEGER NOT NULL,
    last_used_at INTEGER
);
CREATE INDEX api_tokens_by_user ON api_tokens (user_id, id);

-- Where a user's job-end notifications go, and how the latest delivery went.
CREATE TABLE webhooks (
    user_id         INTEGER PRIMARY KEY REFERENCES users (id) ON DELETE CASCADE,
    url             TEXT    NOT NULL,
    updated_at      INTEGER NOT NULL,
    last_job_id     INTEGER,   -- the job the latest delivery was about
    last_at         INTEGER,   -- when it finished (after its retries)
    last_ok         INTEGER,   -- 1 when the receiver answered 2xx
    last_result     TEXT       -- "HTTP 200", or why it failed
);
