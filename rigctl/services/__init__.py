"""Long-running services over the library: the Prometheus exporter and the MCP server."""
