"""Storage: the portable checkpoint, safe (atomic) file writes, run state for resuming."""
