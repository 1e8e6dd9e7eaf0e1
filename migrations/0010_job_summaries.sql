-- Each job's metric summary (best and latest losses, the task score before and after, tokens
-- and time), kept beside its metrics as each step is stored, so that the job list reads one row
-- a job instead of scanning every job's points (each a JSON text holding a per-unit timeline)
-- a dozen times on every request.
--
-- A step stored after the last one updates its job's row from its point alone; a step stored
-- again (step 0's point rewritten with the held-out figures) or metrics dropped on resume
-- recompute the row from the job's points. `step_s` is the sum of the points' step seconds, for
-- the list's tokens a second. The jobs stored before this table are summarised when the
-- server starts, by the same statement.
CREATE TABLE job_summaries (
    job_id          INTEGER PRIMARY KEY REFERENCES jobs (id) ON DELETE CASCADE,
    last_step       INTEGER NOT NULL,
    best_loss       REAL,
    best_loss_step  INTEGER,
    final_loss      REAL,
    final_eval_loss REAL,
    best_eval_loss  REAL,
    best_eval_step  INTEGER,
    task_before     REAL,
    task_score      REAL,
    task_step       INTEGER,
    tokens_seen     INTEGER,
    trained_tokens  INTEGER,
    step_s          REAL
);
