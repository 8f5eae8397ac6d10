"""Context parallelism: the sequence split across the CP group."""
