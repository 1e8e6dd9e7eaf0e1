-- A dataset uploaded with its LLaMA-Factory dataset_info.json: the one-entry registry kept
-- beside the data file (its file_name names that file) and the entry's name. NULL for a
-- dataset read as a plain file.
ALTER TABLE datasets ADD COLUMN registry_file TEXT;
ALTER TABLE datasets ADD COLUMN registry_name TEXT;
