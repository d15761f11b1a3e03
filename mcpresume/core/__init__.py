"""The pure core: every decision of the proxy, with no I/O, no clock and no framework."""
