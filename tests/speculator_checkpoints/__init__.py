"""Tiny speculator checkpoints written exactly as their authors publish them (config keys and weight names from the
public repositories, random weights), one module per layout, for the loader, proposer and server tests."""
