-- Why a cancelled or interrupted job can no longer be resumed, set when something it needs
-- goes: its evaluation dataset deleted (the column that named it is cleared by the delete, so
-- nothing else would remember it had one). NULL while nothing stands in the way.
ALTER TABLE jobs ADD COLUMN resume_ended TEXT;
