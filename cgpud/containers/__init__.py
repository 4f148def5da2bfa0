"""Server side of the container start path: OCI bundle edits, relay socket, CDI, container identity and lifecycle."""
