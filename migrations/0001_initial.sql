-- Accounts, sessions, datasets, the job queue and what jobs produce. Times are unix seconds.

CREATE TABLE users (
    id            INTEGER PRIMARY KEY,
    username      TEXT    NOT NULL UNIQUE COLLATE NOCASE,
    password_hash TEXT    NOT NULL,  -- argon2id PHC string
    role          TEXT    NOT NULL CHECK (role IN ('admin', 'user')),
    created_at    INTEGER NOT NULL
);

-- Anonymous sessions (user_id NULL) exist so that the login and setup forms carry a CSRF token.
CREATE TABLE sessions (
    token      TEXT    PRIMARY KEY,
    user_id    INTEGER REFERENCES users (id) ON DELETE CASCADE,
    csrf       TEXT    NOT NULL,
    expires_at INTEGER NOT NULL
);
CREATE INDEX sessions_by_expiry ON sessions (expires_at);

CREATE TABLE datasets (
    id         INTEGER PRIMARY KEY,
    owner_id   INTEGER REFERENCES users (id) ON DELETE CASCADE,  -- NULL: shared with everyone
    name       TEXT    NOT NULL,
    file_name  TEXT    NOT NULL,  -- under DATA_DIR/datasets, chosen by the server
    format     TEXT    NOT NULL,
    records    INTEGER NOT NULL,
    size_bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);

CREATE TABLE jobs (
    id          INTEGER PRIMARY KEY,
    owner_id    INTEGER NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    model       TEXT    NOT NULL,  -- "preset:<name>" or "local:<folder>"
    dataset_id  INTEGER REFERENCES datasets (id) ON DELETE SET NULL,
    device      TEXT    NOT NULL,  -- "cpu" or "cuda:<n>"
    config      TEXT    NOT NULL,  -- JSON: the hyperparameters as accepted
    status      TEXT    NOT NULL CHECK (status IN
                    ('queued', 'running', 'completed', 'failed', 'cancelled', 'interrupted')),
    queue_seq   INTEGER NOT NULL,  -- order within the device's queue; a resumed job goes last
    error       TEXT,
    total_steps INTEGER NOT NULL DEFAULT 0,  -- 0 until the first start knows it
    step        INTEGER NOT NULL DEFAULT 0,  -- optimizer steps done, over all starts
    start_step  INTEGER NOT NULL DEFAULT 0,  -- `step` when the latest start began (for the ETA)
    started_at  REAL,                        -- when the latest start began
    finished_at INTEGER,
    resume_from TEXT,                        -- checkpoint folder the next start loads
    created_at  INTEGER NOT NULL
);
CREATE INDEX jobs_by_queue ON jobs (device, status, queue_seq);
CREATE INDEX jobs_by_owner ON jobs (owner_id);

-- One row per optimizer step; the point is JSON so new metrics need no schema change.
CREATE TABLE metrics (
    job_id INTEGER NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    step   INTEGER NOT NULL,
    point  TEXT    NOT NULL,
    PRIMARY KEY (job_id, step)
) WITHOUT ROWID;

CREATE TABLE job_logs (
    id     INTEGER PRIMARY KEY,
    job_id INTEGER NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    t      REAL    NOT NULL,
    line   TEXT    NOT NULL
);
CREATE INDEX job_logs_by_job ON job_logs (job_id, id);

-- Folders under DATA_DIR/runs/<job id>/.
CREATE TABLE checkpoints (
    job_id INTEGER NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    name   TEXT    NOT NULL,
    step   INTEGER NOT NULL,
    PRIMARY KEY (job_id, name)
) WITHOUT ROWID;

-- One-time facts about this installation ("demo_dataset_registered").
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;
