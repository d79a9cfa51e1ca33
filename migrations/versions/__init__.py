"""Ledger revisions, oldest first: ``0001_initial`` creates the four tables."""
