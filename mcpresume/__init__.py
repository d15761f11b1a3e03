"""mcpresume: make MCP Streamable HTTP streams resumable, without the upstream knowing."""

__version__ = "0.1.0"
