-- A job's id names its run folder (runs/<id>/), so no id may be given twice, even after the
-- jobs holding the highest ids were deleted with their owner. The highest id ever given is kept
-- in `meta`, and new jobs take the next one (see jobs::store::insert_queued).
INSERT OR IGNORE INTO meta (key, value)
    SELECT 'job_id_high_water', CAST(COALESCE(MAX(id), 0) AS TEXT) FROM jobs;

CREATE TRIGGER jobs_id_high_water AFTER INSERT ON jobs
BEGIN
    UPDATE meta SET value = CAST(NEW.id AS TEXT)
     WHERE key = 'job_id_high_water' AND CAST(value AS INTEGER) < NEW.id;
END;
