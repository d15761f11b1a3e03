"""Reusable test infrastructure: a cutting TCP relay and helpers to drive the official MCP SDK client."""
