"""Runnable examples (docs/agents.md): ``python -m examples.agent_server`` and friends."""
