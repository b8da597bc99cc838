"""Saving runs: the store (lock, journal, atomic profile write), profiles and their schema, and the session
that every command's run goes through."""
