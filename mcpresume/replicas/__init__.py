"""Several replicas over one store: the hop to a session's owner, and this replica's lease."""
