-- A job's demo link: a read-only, full-screen view of its live figures (for a projector) that
-- anyone with the link opens without an account, for as long as its owner keeps it on.
--
-- The token is kept as it is, unlike an API token's hash: the owner must be able to copy the
-- link again later, and it opens only the figures of one job (no data, checkpoints, settings
-- or log). Turning the link off deletes the row, and so does deleting the job.
CREATE TABLE demo_links (
    job_id     INTEGER PRIMARY KEY REFERENCES jobs (id) ON DELETE CASCADE,
    token      TEXT    NOT NULL UNIQUE,
    created_at INTEGER NOT NULL
);
