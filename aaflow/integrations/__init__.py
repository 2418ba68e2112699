"""Adapters for agent frameworks (optional extras): `aaflow.integrations.langgraph`. Layer: front end."""
