-- A job carries a name and a note its owner gives it (empty when none), and each user may have
-- a storage quota in bytes set by an admin (NULL: no quota) that submits and uploads respect.
ALTER TABLE jobs ADD COLUMN name TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN note TEXT NOT NULL DEFAULT '';
ALTER TABLE users ADD COLUMN quota_bytes INTEGER;
