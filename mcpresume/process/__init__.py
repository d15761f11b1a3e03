"""What one process holds beside the shared store: its settings, metrics, views and readers, and its drain."""
