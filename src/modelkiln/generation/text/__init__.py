"""From token ids to text: incremental detokenization and stop strings."""
