"""rallypoint.agent."""
