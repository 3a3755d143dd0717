"""rollhub."""
