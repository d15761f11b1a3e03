"""The daemon: the assembly of the layers below, the command line, the demo."""
