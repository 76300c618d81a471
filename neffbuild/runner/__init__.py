"""Worker processes: the job protocol, supervision, scratch dirs and kept logs."""
