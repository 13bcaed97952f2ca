"""rallypoint.adapters."""
