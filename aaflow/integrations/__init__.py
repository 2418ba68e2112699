"""Adapters for agent frameworks (optional extras): `aaflow.integrations.langgraph`."""
