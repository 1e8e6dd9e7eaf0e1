-- How a dataset's records are read, decided at upload and used again by every job on it:
-- a lenient upload skips invalid records (how many, and the first 100 as JSON
-- [{"line", "reason"}]), and a table's columns are renamed to a format's fields (JSON
-- {"role": "column"}). `layout` is the file's: jsonl, json, csv, tsv or parquet.
ALTER TABLE datasets ADD COLUMN skip_invalid INTEGER NOT NULL DEFAULT 0;
ALTER TABLE datasets ADD COLUMN skipped INTEGER NOT NULL DEFAULT 0;
ALTER TABLE datasets ADD COLUMN skipped_records TEXT NOT NULL DEFAULT '[]';
ALTER TABLE datasets ADD COLUMN columns TEXT NOT NULL DEFAULT '{}';
ALTER TABLE datasets ADD COLUMN layout TEXT NOT NULL DEFAULT 'jsonl';
