-- Jobs carry the engine's job description: `config` holds the engine's JobSettings (JSON), a
-- job may evaluate on a second dataset, and each start records the placement the planner chose.
-- `device` may now name several GPUs ("cuda:0,1"); `resume_from` is no longer used (a resume
-- continues from the run folder's saved training state).
ALTER TABLE jobs ADD COLUMN eval_dataset_id INTEGER REFERENCES datasets (id) ON DELETE SET NULL;
ALTER TABLE jobs ADD COLUMN placement TEXT;
