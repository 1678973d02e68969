"""Hooks on the user's model that exist only while they are needed: activation capture, NaN forensics."""
