"""Load generators against a running server (`kimiserve bench serve`)."""
