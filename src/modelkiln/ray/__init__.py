"""Ray Serve: ``kiln ray`` (plan.py: the layout; deployments.py: the replicas; command.py: the CLI)."""
