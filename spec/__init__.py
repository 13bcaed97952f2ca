"""rallypoint.spec."""
