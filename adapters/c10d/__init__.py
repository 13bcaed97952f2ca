"""rallypoint.adapters.c10d."""
