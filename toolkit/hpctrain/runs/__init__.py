"""The run folder (the contract between login side and ranks) and the SQLite registry of runs."""
