"""Example MCP upstreams built with the official SDK (optional ``demo`` extra)."""
